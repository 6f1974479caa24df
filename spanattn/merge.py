"""Merging partial attention by its log-sum-exp: the softmax over a union of disjoint key sets
from the results over each part. What cascade prefixes, context parallelism and split-KV decode
need.

For parts A and B of one query's keys with ``lse = log sum exp(s)`` over each part:

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b)

An empty part has ``lse = -inf`` and contributes nothing; two empty parts give ``out = 0`` and
``lse = -inf`` (never NaN): a row that saw no key stays finite. A part whose ``lse`` is ``+inf``
(a score that overflowed) takes the whole weight, and two such parts half each, with ``lse =
+inf``: the limit of ``lse_a = lse_b -> inf``, where ``exp(lse_a - lse)`` alone would be NaN.
"""

from __future__ import annotations

import torch


def _check(out_a, lse_a, out_b, lse_b) -> None:
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.dim() != 3:
        raise ValueError(f"out_a must be [tokens, heads, head_dim], got shape {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b must have out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:2]:
            raise ValueError(
                f"{name} must be [tokens, heads] = {tuple(out_a.shape[:2])}, got {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (fp32 natural log), got {t.dtype}")
    if out_a.dtype != out_b.dtype:
        raise TypeError(f"out_a and out_b must share a dtype, got {out_a.dtype} and {out_b.dtype}")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"out_a, lse_a, out_b, lse_b must be on one device, got {sorted(map(str, devices))}")


def merge_attention_states(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results over disjoint key sets of the same queries.

    out_*: ``[tokens, heads, head_dim]`` (any float dtype, both the same);
    lse_*: ``[tokens, heads]`` natural-log softmax denominators (fp32, scale applied), as
    ``spanattn.attention(..., return_lse=True)`` returns them.
    Returns ``(out, lse)``: ``out`` in out_a's dtype, ``lse`` fp32. Vectorized, no host sync, so
    it can sit inside a captured CUDA graph.

    >>> import torch
    >>> o = torch.ones(1, 1, 2); lse = torch.zeros(1, 1)
    >>> out, l = merge_attention_states(o, lse, 3 * o, torch.full((1, 1), float("-inf")))
    >>> out.tolist(), l.tolist()
    ([[[1.0, 1.0]]], [[0.0]])
    """
    _check(out_a, lse_a, out_b, lse_b)
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    # Both parts empty (-inf) or one infinite (+inf): shift by 0 instead, so that exp gives finite
    # weights, never inf - inf; an infinite part's weight is 1 (the other's 0) below.
    top = torch.isposinf(m)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = torch.where(top, (la == float("inf")).float(), torch.exp(la - m))
    wb = torch.where(top, (lb == float("inf")).float(), torch.exp(lb - m))
    total = wa + wb
    lse = torch.where(top, float("inf"), m + torch.log(total))  # log(0) = -inf for two empty parts
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    out = out_a.float() * (wa * inv)[..., None] + out_b.float() * (wb * inv)[..., None]
    return out.to(out_a.dtype), lse
