"""The group ids of groups.py (``q_group``, ``k_group``) in ONE Triton launch: the CUDA lowering.

``groups.group_ids_torch`` stays the definition (tests hold the two equal, exactly, under
``TRITON_INTERPRET=1`` without a GPU); on a GPU it is ~30 tiny kernels, launch-bound. The
first ``q_blocks`` programs take ``BLOCK`` packed queries each, the rest ``BLOCK`` packed keys:

- the row's sequence: binary search over ``cu_seqlens_q`` or ``_k`` (``triton_search.seq_of_rows``);
- its position: a query's is ``kv_len - q_len + i``, a key's its index in the sequence;
- the span that may hold it (``triton_search.span_at`` over step_tensors' ``spans``); inside
  it, the span's ``span_group`` entry (-1: a span without a group), else -1.

As in intervals_triton.py, lengths and counts are runtime scalars exempt from Triton's value
specialization and the inputs start on 16 bytes: a new step never compiles a new kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_search import seq_of_rows, span_at

# every scalar whose value changes from step to step
RUNTIME_ARGS = ["total_q", "total_k", "q_blocks", "num_seqs", "num_spans", "seq_steps", "span_steps"]


@triton.jit
def _group_of_rows(
    rows, total, cu_ptr, kv_len_ptr, spans_ptr, span_group_ptr, out_ptr,
    num_seqs, num_spans, seq_steps, span_steps, QUERIES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    valid = rows < total
    seq = seq_of_rows(cu_ptr, rows, num_seqs, seq_steps, BLOCK)
    if QUERIES:  # the chunk's queries are its sequence's last q_len positions
        pos = rows + tl.load(kv_len_ptr + seq) - tl.load(cu_ptr + seq + 1)
    else:
        pos = rows - tl.load(cu_ptr + seq)
    j = span_at(spans_ptr, seq, pos, num_spans, span_steps, BLOCK)
    found = (j >= 0) & valid
    s_seq = tl.load(spans_ptr + j * 3, mask=found, other=-1)
    e = tl.load(spans_ptr + j * 3 + 2, mask=found, other=-1)
    inside = found & (s_seq == seq) & (pos <= e)
    group = tl.load(span_group_ptr + j, mask=inside, other=-1)
    tl.store(out_ptr + rows, group, mask=valid)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _group_ids_kernel(
    kv_len_ptr, cu_q_ptr, cu_k_ptr, spans_ptr, span_group_ptr, q_group_ptr, k_group_ptr,
    total_q, total_k, q_blocks, num_seqs, num_spans, seq_steps, span_steps, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < q_blocks:
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        _group_of_rows(
            rows, total_q, cu_q_ptr, kv_len_ptr, spans_ptr, span_group_ptr, q_group_ptr,
            num_seqs, num_spans, seq_steps, span_steps, True, BLOCK,
        )  # fmt: skip
    else:
        rows = (pid - q_blocks) * BLOCK + tl.arange(0, BLOCK)
        _group_of_rows(
            rows, total_k, cu_k_ptr, kv_len_ptr, spans_ptr, span_group_ptr, k_group_ptr,
            num_seqs, num_spans, seq_steps, span_steps, False, BLOCK,
        )  # fmt: skip


def launch_args(step: dict, total_q: int, total_k: int, q_group, k_group, BLOCK: int = 1024):
    """Grid, arguments and constexprs of one launch (the tests read the compile key off them)."""
    n, m = step["kv_len"].shape[0], step["spans"].shape[0]
    q_blocks = -(-total_q // BLOCK)
    args = (
        step["kv_len"], step["cu_seqlens_q"], step["cu_seqlens_k"], step["spans"], step["span_group"],
        q_group, k_group, total_q, total_k, q_blocks, n, m, n.bit_length(), m.bit_length(),
    )  # fmt: skip
    return (q_blocks + -(-total_k // BLOCK),), args, dict(BLOCK=BLOCK)


def group_ids_triton(step: dict, total_q: int, total_k: int, BLOCK: int = 1024):
    """``q_group, k_group`` (int32 ``[total_q]``, ``[total_k]``) from :func:`intervals.step_tensors`'
    tensors of a step with span groups, one launch."""
    dev = step["kv_len"].device
    q_group = torch.empty(total_q, dtype=torch.int32, device=dev)
    k_group = torch.empty(total_k, dtype=torch.int32, device=dev)
    grid, args, constexprs = launch_args(step, total_q, total_k, q_group, k_group, BLOCK)
    _group_ids_kernel[grid](*args, **constexprs)
    return q_group, k_group
