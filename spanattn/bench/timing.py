"""Timing and checking helpers of the benchmark: kernel time (median, CUDA events through
``triton.testing.do_bench`` where it imports), host-side planning time, and the reference check
with poisoned memory."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def kernel_ms(fn, device, reps: int = 10) -> float:
    """Median milliseconds of ``fn()`` after warm-up. CUDA: ``do_bench`` (CUDA events, L2
    flushed between runs); CPU: wall clock around each call."""
    if torch.device(device).type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            return _events_ms(fn, reps)
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(max(3, reps // 3)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _events_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, device, reps: int = 10) -> float:
    """Median wall milliseconds of ``fn()`` up to its device work being done: what a step pays
    to plan (host code, small kernels, host-to-device copies)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def poison(device, nbytes: int) -> None:
    """Fill and free a block of memory with NaN so the next allocations of the caching
    allocator (CUDA) likely start as NaN: an output row a kernel forgets shows as NaN."""
    if torch.device(device).type == "cuda":
        torch.full((nbytes // 4 + 1,), float("nan"), device=device, dtype=torch.float32)
