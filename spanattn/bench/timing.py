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


def rotated(names: list, r: int) -> list:
    """``names`` starting at ``r`` (mod its length): who goes first moves by one each round."""
    k = r % len(names)
    return names[k:] + names[:k]


def turns_ms(fns: dict, device, calls: int, first: int = 0) -> dict[str, list[float]]:
    """Milliseconds of each of ``calls`` calls of each ``fns[name]()``, the contenders taking turns
    call by call (who opens a turn rotates, starting at ``first``), so that clock and power
    drifts reach every contender alike: timed in blocks of ~100 ms of calls, one after another,
    FA4's plain kernel spread over 6.52-7.06 ms in the 7 rounds of one call on the H200 (S2 d128
    in results/2026-12-04-short-walks-all-7-rounds-h200.json); the fa4 backend on S0 (FA4's own
    kernel) came out at 1.000 / 1.001 of FA4's call in turns, 1.001 / 1.017 in blocks (d128 /
    d256; twins of one call on S2 still differed by 0.5-1.2% in either). The price: a call then
    runs at a clock its neighbours set too, and the H200 clocks kernels differently
    (tools/kernel_lab/clocks.py), so a kernel the GPU clocks lower when it runs alone gains here
    (FA4's sparse call with its query tiles dealt longest first: +2% in turns, -1% in blocks and back
    to back: results/2026-12-04-fa4-chunk-order-h200.json). CUDA: events around each call, L2
    flushed before it (as ``do_bench`` does); the queue is never drained between calls. CPU: wall
    clock around each call. Call every ``fn`` once before (compilation, caches)."""
    names = list(fns)
    cuda = torch.device(device).type == "cuda"
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=device) if cuda else None
    marks = {n: [] for n in names}
    for t in range(calls):
        for n in rotated(names, first + t):
            if cuda:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[n]()
                end.record()
                marks[n].append((start, end))
            else:
                t0 = time.perf_counter()
                fns[n]()
                marks[n].append((time.perf_counter() - t0) * 1e3)
    if not cuda:
        return marks
    torch.cuda.synchronize(device)
    return {n: [s.elapsed_time(e) for s, e in m] for n, m in marks.items()}


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
