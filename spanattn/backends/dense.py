"""What the dense backends (reference, sdpa) share: their walk over a step's sequences with each
one's dense mask from the intervals, and their outputs. Everything here runs on the host per
sequence, so a device plan's lengths are read there."""

from __future__ import annotations

import torch

from ..cache import _slots
from ..intervals import dense_from_intervals


def capture_refusal(q, plan) -> str | None:
    """The dense backends walk sequences on the host: a device plan's lengths must be read
    there, which a CUDA graph being captured cannot do."""
    if plan.capacity is not None and q.is_cuda and torch.cuda.is_current_stream_capturing():
        return "it reads a device plan's lengths on the host, which a CUDA graph capture cannot; use triton"
    return None


def per_sequence(q, k, v, plan, block_table=None):
    """The dense backends' walk: ``(rows, mask, k_i, v_i)`` per sequence with queries, ``rows``
    its slice of the packed queries, ``mask`` its boolean ``[q_len, kv_len]`` from the intervals,
    ``k_i, v_i [kv_len, Hq, D]`` its keys and values (pages read through its block table row,
    K/V heads repeated for GQA; block ids clamped into the cache, see ``cache._slots``)."""
    group = q.shape[1] // k.shape[-2]
    if block_table is not None:
        num_blocks, page = k.shape[:2]
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    for i, q0, q1, k0, kv_len in plan.host_layout():
        if block_table is not None:
            pos = torch.arange(kv_len, device=k.device)
            slots = _slots(block_table, page, i, pos, num_blocks)
            ki, vi = k[slots], v[slots]
        else:
            ki, vi = k[k0 : k0 + kv_len], v[k0 : k0 + kv_len]
        if group > 1:
            ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
        if plan.groups is None:  # a device plan too (it has no groups)
            mask = dense_from_intervals(plan.lo[q0:q1], plan.hi[q0:q1], kv_len)
        else:
            mask = plan.dense_rows(slice(q0, q1), k0, kv_len)
        mask = mask.to(q.device)
        yield slice(q0, q1), mask, ki, vi


def outputs(q, v, return_lse: bool, plan):
    """``out [total_q, Hq, D]`` (q's dtype) and ``lse [total_q, Hq]`` (``lse_dtype``) or None; NaN for a
    device plan, whose rejected sequences and padding rows no sequence writes."""

    def new(shape, dtype):
        if plan.capacity is None:
            return torch.empty(shape, dtype=dtype, device=q.device)
        return torch.full(shape, float("nan"), dtype=dtype, device=q.device)

    out = new((*q.shape[:2], v.shape[-1]), q.dtype)
    return out, new(q.shape[:2], lse_dtype(q)) if return_lse else None


def lse_dtype(q) -> torch.dtype:
    """The LSE's dtype: float32, float64 for float64 inputs (checks such as gradcheck)."""
    return torch.promote_types(q.dtype, torch.float32)
