"""torch's scaled_dot_product_attention with the dense mask of each sequence: the portable
fallback. O(q_len * kv_len) memory for the mask; no softcap (SDPA has none)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import capture_refusal, outputs, per_sequence
from .dense_backward import backward as backward  # the op's backward under torch.compile

DEVICE_PLANS = True  # as the reference backend: not while capturing a graph
NATIVE_AUTOGRAD = True  # as the reference backend: torch's autograd differentiates SDPA in eager calls
# torch's SDPA backward on CUDA (the memory-efficient kernel, the one that takes a mask) does not
# repeat its bits call to call (H100, torch 2.11: every head_dim of train_walks.py); values hold
# the rule, and each sequence is its own call, so isolation holds in value.
REPEATABLE_BACKWARD_ON_CUDA = False


def unavailable(q, plan, *, softcap=None, **opts) -> str | None:
    if softcap:
        return "the sdpa backend has no logit softcap (torch SDPA cannot apply one)"
    return capture_refusal(q, plan)


def no_backward(q, plan, **opts) -> str | None:
    return None


def forward(q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None):
    out, lse = outputs(q, v, return_lse, plan)
    # K/V heads repeated: enable_gqa needs torch >= 2.5 and not every SDPA kernel takes it with a mask
    for rows, mask, ki, vi in per_sequence(q, k, v, plan, block_table):
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[rows], ki, vi))  # [1, Hq, len, D]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[rows] = o[0].transpose(0, 1)
        if return_lse:
            # SDPA does not return the log-sum-exp; recompute it from the scores in fp32.
            s = (qi[0].to(lse.dtype) @ ki[0].to(lse.dtype).transpose(-1, -2)) * scale
            lse[rows] = torch.logsumexp(s.masked_fill(~mask, float("-inf")), -1).transpose(0, 1)
    return out, lse
