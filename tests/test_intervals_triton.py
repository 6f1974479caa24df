"""intervals_triton.py (one launch, plan()'s default on CUDA) equals intervals.py's torch
definition exactly; without a GPU the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # set before triton loads (conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import given, settings
from strategies import batches, layers
from triton_cpu import DEV, load

import spanattn as sa
from spanattn.intervals import compute_intervals, intervals_torch, step_tensors

intervals_triton = load("intervals_triton", "_intervals_kernel")


def assert_same(batch: sa.Batch, layer: sa.LayerMask):
    step = step_tensors(batch, torch.device(DEV))
    want = intervals_torch(layer, step, batch.total_q)
    got = compute_intervals(layer, step, batch.total_q, fused=True)
    for name, a, b in zip(("lo", "hi"), want, got):
        assert b.dtype == torch.int32 and torch.equal(a, b), (name, batch, layer)


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_seqs=6), layer=layers())
def test_kernel_equals_torch(batch, layer):
    assert_same(batch, layer)


EDGE_BATCHES = {
    "single token": sa.Batch([sa.Seq(1)]),
    "decode rows": sa.Batch([sa.Seq(q_len=1, kv_len=731), sa.Seq(q_len=1, kv_len=5, spans=[(0, 4)])]),
    # spans at or past kv_len belong to later chunks: step_tensors drops them, and a dropped
    # span of seq 0 must not shadow seq 1's spans in the (seq, start) search
    "spans past the chunk": sa.Batch(
        [sa.Seq(q_len=6, kv_len=10, spans=[(2, 4), (10, 14)], prompt_len=20), sa.Seq(8, spans=[(0, 3)])]
    ),
    "prefix hit mid span": sa.Batch([sa.Seq(q_len=5, kv_len=12, spans=[(3, 9)], causal=False)]),
    "split span": sa.Batch(
        [sa.Seq(q_len=4, kv_len=10, spans=[(6, 12)], prompt_len=20)], allow_split_spans=True
    ),
    "many seqs": sa.Batch(
        [
            sa.Seq(q_len=1 + i % 5, kv_len=3 + 2 * i, causal=i % 3 > 0, spans=[(1, 2)] * (i % 2))
            for i in range(37)
        ]
    ),
}
EDGE_LAYERS = [
    sa.LayerMask(window=1, spans="clamp"),
    sa.LayerMask(window=1, spans="on", noncausal_window="inclusive"),
    sa.LayerMask(window=3, spans="clamp", noncausal_window="inclusive"),
    sa.LayerMask(window=4, spans="off"),
    sa.LayerMask(window=10**6),
    sa.LayerMask(window=2**40, spans="clamp", noncausal_window="inclusive"),  # an int64 scalar
    sa.LayerMask(spans="clamp"),
]


@pytest.mark.parametrize("name", EDGE_BATCHES)
def test_edge_cases(name):
    for layer in EDGE_LAYERS:
        assert_same(EDGE_BATCHES[name], layer)


def test_plan_dispatches_to_the_kernel_on_cuda(monkeypatch):
    calls = []
    real = intervals_triton.intervals_triton
    monkeypatch.setattr(intervals_triton, "intervals_triton", lambda *a: calls.append(1) or real(*a))
    p = sa.plan(EDGE_BATCHES["decode rows"], sa.LayerMask(window=100), DEV)
    assert p.lo.tolist() == [631, 0] and p.hi.tolist() == [730, 4]
    assert len(calls) == (DEV == "cuda")


STEPS = [  # different lengths, sequence counts and span counts (none, one, many)
    sa.Batch([sa.Seq(1)]),
    sa.Batch([sa.Seq(q_len=16, kv_len=32, spans=[(1, 3)]), sa.Seq(3, causal=False)]),
    sa.Batch([sa.Seq(q_len=100, kv_len=300, spans=[(1, 3), (5, 9), (250, 299)])] * 5),
]


def compile_keys(kernel, launches) -> tuple[list[str], list[str]]:
    """The key Triton would compile each launch's ``(args, constexprs)`` under, with the
    kernel's own options and with Triton's defaults, read with Triton's binder (internals: the
    test skips if they moved). The interpreter compiles nothing, so this stands in for the
    device cache on CPU."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        def keys(**options):
            jit = JITFunction(kernel.fn, **options)
            binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
            return [str(binder(*args, **constexprs)[1]) for args, constexprs in launches]

        return keys(**kernel.kwargs), keys()
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"Triton's specialization internals changed: {e}")


def test_steps_share_one_compiled_kernel():
    """Lengths and counts are runtime values: a new step never compiles a new kernel."""
    layer = sa.LayerMask(window=16, spans="clamp")
    kernel = intervals_triton._intervals_kernel
    if DEV == "cuda":  # Triton's own per-device cache of compiled kernels
        sa.plan(STEPS[0], layer, DEV)
        compiled = kernel.device_caches[torch.cuda.current_device()][0]
        size = len(compiled)
        for batch in STEPS[1:]:
            sa.plan(batch, layer, DEV)
        assert len(compiled) == size
        return
    launches = []
    for batch in STEPS:
        step, q = step_tensors(batch, DEV), torch.empty(batch.total_q, dtype=torch.int32)
        _, args, constexprs = intervals_triton.launch_args(layer, step, batch.total_q, q, q.clone())
        launches.append((args, constexprs))
    ours, default = compile_keys(kernel, launches)
    assert len(set(ours)) == 1
    assert len(set(default)) > 1  # without do_not_specialize these steps would recompile
