"""torch's scaled_dot_product_attention with the dense mask of each sequence: the portable
fallback. O(q_len * kv_len) memory for the mask; no softcap (SDPA has none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import gather_kv


def unavailable(q, plan, *, softcap=None, **opts) -> str | None:
    if softcap:
        return "the sdpa backend has no logit softcap (torch SDPA cannot apply one)"
    return None


def forward(q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None):
    if block_table is not None:  # paged: copy the pages out into packed K/V
        k, v = gather_kv(k, v, block_table, plan)
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape[0], hq, v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], hq, dtype=torch.float32, device=q.device) if return_lse else None
    cu_k = plan.cu_seqlens_k.tolist()
    for i in range(plan.num_seqs):
        rows = plan.seq_slice(i)
        mask = plan.to_dense(i).to(q.device)
        qi = q[rows].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)[None]
        if hq != hkv:
            # enable_gqa needs torch >= 2.5 and not every SDPA kernel takes it with a mask
            ki = ki.repeat_interleave(hq // hkv, dim=1)
            vi = vi.repeat_interleave(hq // hkv, dim=1)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[rows] = o[0].transpose(0, 1)
        if return_lse:
            # SDPA does not return the log-sum-exp; recompute it from the scores in fp32.
            s = (qi[0].float() @ ki[0].float().transpose(-1, -2)) * scale
            lse[rows] = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1).transpose(0, 1)
    return out, lse
