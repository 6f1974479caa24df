"""The oracle: a dense mask from the intervals and plain softmax attention in fp32 (fp64 on
request), one sequence at a time. Runs anywhere; slow on purpose."""

from __future__ import annotations

import torch

from ..cache import gather_kv


def unavailable(q, plan, **opts) -> str | None:
    return None


def per_sequence(q, k, v, plan, block_table=None):
    """The dense backends' walk: ``(i, rows, k_i, v_i)`` per sequence, ``rows`` its slice of the
    packed queries and ``k_i, v_i [kv_len, Hq, D]`` its keys and values (pages copied out, K/V
    heads repeated for GQA)."""
    if block_table is not None:
        k, v = gather_kv(k, v, block_table, plan)
    group = q.shape[1] // k.shape[1]
    cu_k = plan.cu_seqlens_k.tolist()
    start = 0
    for i, s in enumerate(plan.batch.seqs):
        ki, vi = k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        if group > 1:
            ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)
        yield i, slice(start, start + s.q_len), ki, vi
        start += s.q_len


def outputs(q, v, return_lse: bool):
    """Empty ``out [total_q, Hq, D]`` (q's dtype) and ``lse [total_q, Hq]`` (fp32) or None."""
    out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    return out, lse


def forward(
    q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None, compute_dtype=torch.float32
):
    out, lse = outputs(q, v, return_lse)
    for i, rows, ki, vi in per_sequence(q, k, v, plan, block_table):
        qi = q[rows].to(compute_dtype).transpose(0, 1)  # [Hq, q_len, D]
        ki, vi = ki.to(compute_dtype), vi.to(compute_dtype)
        scores = qi @ ki.permute(1, 2, 0) * scale  # [Hq, q_len, kv_len]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~plan.to_dense(i).to(q.device), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # never -inf: every row allows k = q
        probs = torch.exp(scores - row_lse[..., None])
        out[rows] = (probs @ vi.transpose(0, 1)).transpose(0, 1).to(q.dtype)
        if return_lse:
            lse[rows] = row_lse.transpose(0, 1).float()
    return out, lse
