"""The oracle: a dense mask from the intervals and plain softmax attention in fp32 (fp64 on
request), one sequence at a time. Runs anywhere; slow on purpose."""

from __future__ import annotations

import torch

from ..cache import gather_kv


def unavailable(q, plan, **opts) -> str | None:
    return None


def forward(
    q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None, compute_dtype=torch.float32
):
    if block_table is not None:  # paged: copy the pages out into packed K/V
        k, v = gather_kv(k, v, block_table, plan)
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape[0], hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], hq, dtype=torch.float32, device=q.device) if return_lse else None
    cu_k = plan.cu_seqlens_k.tolist()
    for i in range(plan.num_seqs):
        rows = plan.seq_slice(i)
        qi = q[rows].to(compute_dtype).transpose(0, 1)  # [Hq, q_len, D]
        ki = k[cu_k[i] : cu_k[i + 1]].to(compute_dtype).repeat_interleave(hq // hkv, dim=1)
        vi = v[cu_k[i] : cu_k[i + 1]].to(compute_dtype).repeat_interleave(hq // hkv, dim=1)
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
