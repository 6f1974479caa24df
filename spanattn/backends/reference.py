"""The oracle: a dense mask from the intervals and plain softmax attention in fp32 (fp64 on
request), one sequence at a time. Runs anywhere; slow on purpose. In fp32 its two products are
exact_matmul's, so that its bits do not depend on the BLAS's threads or operand alignment."""

from __future__ import annotations

import torch

from ..cache import _slots
from ..exact_matmul import exact_matmul
from ..intervals import dense_from_intervals

DEVICE_PLANS = True  # reads a device plan's lengths on the host: not while capturing a graph


def unavailable(q, plan, **opts) -> str | None:
    return capture_refusal(q, plan)


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
    """``out [total_q, Hq, D]`` (q's dtype) and ``lse [total_q, Hq]`` (fp32) or None; NaN for a
    device plan, whose rejected sequences and padding rows no sequence writes."""

    def new(shape, dtype):
        if plan.capacity is None:
            return torch.empty(shape, dtype=dtype, device=q.device)
        return torch.full(shape, float("nan"), dtype=dtype, device=q.device)

    out = new((*q.shape[:2], v.shape[-1]), q.dtype)
    return out, new(q.shape[:2], torch.float32) if return_lse else None


def forward(
    q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None, compute_dtype=torch.float32
):
    out, lse = outputs(q, v, return_lse, plan)
    matmul = exact_matmul if compute_dtype == torch.float32 else torch.matmul
    for rows, mask, ki, vi in per_sequence(q, k, v, plan, block_table):
        qi = q[rows].to(compute_dtype).transpose(0, 1)  # [Hq, q_len, D]
        ki, vi = ki.to(compute_dtype), vi.to(compute_dtype)
        scores = matmul(qi, ki.permute(1, 2, 0)) * scale  # [Hq, q_len, kv_len]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # never -inf: every row allows k = q
        probs = torch.exp(scores - row_lse[..., None])
        out[rows] = matmul(probs, vi.transpose(0, 1)).transpose(0, 1).to(q.dtype)
        if return_lse:
            lse[rows] = row_lse.transpose(0, 1).float()
    return out, lse
