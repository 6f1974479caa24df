"""The intervals of intervals.py in ONE Triton launch: the CUDA lowering of the same semantics.

``intervals.intervals_torch`` stays the definition (tests hold the two equal, exactly, under
``TRITON_INTERPRET=1`` without a GPU); this exists because on a GPU the torch version is ~20
tiny kernels, launch-bound at 0.3-0.8 ms per step. One program per ``BLOCK`` packed queries:

- the query's sequence: binary search over ``cu_seqlens_q`` (sequences are never empty, so
  the last ``r`` with ``cu_q[r] <= token``);
- the span that may hold it: binary search over all spans of the step, ordered by
  ``(seq, start)``: the last one at or before ``(r, q)`` (``triton_search.span_at``); it holds
  ``q`` if same seq and ``q <= e``;
- then the formulas of intervals.py, line for line.

Nothing that changes between steps is a compile-time constant: lengths, counts and the window
are runtime scalars, exempt from Triton's value specialization (``== 1``, ``% 16``), and the
inputs sliced out of step_tensors' one buffer all start on 16 bytes (pointer alignment is
specialized too). Only the layer's policy, ``PADDED`` and ``BLOCK`` pick a compiled kernel.

``PADDED`` (device plans, device_planner.py): the counts are capacities, the step's real extent is
read on the device (``cu_q[num_seqs]``), and rows past it or of a sequence with ``kv_len`` 0 get
the empty interval ``(0, -1)``, as in ``intervals_torch``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .spec import LayerMask
from .triton_search import seq_of_rows, span_at

SPAN_MODE = {"off": 0, "on": 1, "clamp": 2}
# every scalar whose value changes from step to step
RUNTIME_ARGS = ["total_q", "num_seqs", "num_spans", "seq_steps", "span_steps", "window"]


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _intervals_kernel(
    kv_len_ptr, causal_ptr, cu_q_ptr, spans_ptr, lo_ptr, hi_ptr,
    total_q, num_seqs, num_spans, seq_steps, span_steps, window,
    HAS_WINDOW: tl.constexpr, INCLUSIVE: tl.constexpr, MODE: tl.constexpr, PADDED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = token < total_q
    seq = seq_of_rows(cu_q_ptr, token, num_seqs, seq_steps, BLOCK)
    kv_len = tl.load(kv_len_ptr + seq)
    causal = tl.load(causal_ptr + seq) != 0
    # positions fit int32 (cu_seqlens are int32); sums with the window may not: int64 for those
    q = token + kv_len - tl.load(cu_q_ptr + seq + 1)
    last = kv_len - 1
    q64 = q.to(tl.int64)

    if HAS_WINDOW:
        if INCLUSIVE:  # non-causal rows: |q - k| <= W; causal rows keep q - k < W
            past = tl.where(causal, q64 - window + 1, q64 - window)
            reach = q64 + window
        else:
            past = q64 - window + 1
            reach = q64 + window - 1
        lo = tl.maximum(past, 0).to(tl.int32)
        hi = tl.where(causal, q, tl.minimum(reach, last).to(tl.int32))
    else:
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.where(causal, q, last)

    if MODE != 0:
        j = span_at(spans_ptr, seq, q, num_spans, span_steps, BLOCK)
        found = (j >= 0) & valid
        s_seq = tl.load(spans_ptr + j * 3, mask=found, other=-1)
        s = tl.load(spans_ptr + j * 3 + 1, mask=found, other=0)
        e = tl.load(spans_ptr + j * 3 + 2, mask=found, other=-1)
        inside = found & (s_seq == seq) & (q <= e)
        span_hi = tl.minimum(e, last)
        if MODE == 1 or not HAS_WINDOW:
            span_lo = s
        else:
            span_lo = tl.maximum(s.to(tl.int64), q64 - window + 1).to(tl.int32)
        lo = tl.where(inside, tl.minimum(lo, span_lo), lo)
        hi = tl.where(inside, tl.maximum(hi, span_hi), hi)

    if PADDED:
        dead = (token >= tl.load(cu_q_ptr + num_seqs)) | (last < 0)
        lo = tl.where(dead, 0, lo)
        hi = tl.where(dead, -1, hi)
    tl.store(lo_ptr + token, lo, mask=valid)
    tl.store(hi_ptr + token, hi, mask=valid)


def launch_args(layer: LayerMask, step: dict, total_q: int, lo, hi, BLOCK: int = 1024):
    """Grid, arguments and constexprs of one launch (the tests read the compile key off them)."""
    n, spans = step["q_len"].shape[0], step["spans"]
    m = spans.shape[0] if layer.spans != "off" else 0
    w = layer.window
    args = (
        step["kv_len"], step["causal"], step["cu_seqlens_q"], spans, lo, hi,
        total_q, n, m, n.bit_length(), m.bit_length(), 0 if w is None else w,
    )  # fmt: skip
    constexprs = dict(
        HAS_WINDOW=w is not None,
        INCLUSIVE=layer.noncausal_window == "inclusive",
        MODE=SPAN_MODE[layer.spans],
        PADDED=bool(step.get("padded")),
        BLOCK=BLOCK,
    )
    return (-(-total_q // BLOCK),), args, constexprs


def intervals_triton(layer: LayerMask, step: dict, total_q: int, BLOCK: int = 1024):
    """``lo, hi`` (int32 ``[total_q]``) from :func:`intervals.step_tensors`' tensors, one launch."""
    dev = step["kv_len"].device
    lo = torch.empty(total_q, dtype=torch.int32, device=dev)
    hi = torch.empty(total_q, dtype=torch.int32, device=dev)
    grid, args, constexprs = launch_args(layer, step, total_q, lo, hi, BLOCK)
    _intervals_kernel[grid](*args, **constexprs)
    return lo, hi
