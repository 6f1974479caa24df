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

Differentiable (torch's autograd through torch ops: cascade and context-parallel training), with
finite gradients in those cases too: no branch that ``torch.where`` leaves out computes an
infinity, since its backward multiplies the left-out branch's derivative by 0.
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


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets of the same queries.

    out_*: ``[tokens, heads, head_dim]`` (any float dtype, both the same);
    lse_*: ``[tokens, heads]`` natural-log softmax denominators (fp32, scale applied), as
    ``spanattn.attention(..., return_lse=True)`` returns them.
    Returns ``(out, lse)``: ``out`` in out_a's dtype, ``lse`` fp32 (fp64 for fp64 inputs).
    Vectorized, no host sync, so it can sit inside a captured CUDA graph.

    >>> import torch
    >>> o = torch.ones(1, 1, 2); lse = torch.zeros(1, 1)
    >>> out, l = merge_attention_states(o, lse, 3 * o, torch.full((1, 1), float("-inf")))
    >>> out.tolist(), l.tolist()
    ([[[1.0, 1.0]]], [[0.0]])
    """
    _check(out_a, lse_a, out_b, lse_b)
    dtype = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    la, lb = lse_a.to(dtype), lse_b.to(dtype)
    m = torch.maximum(la, lb)
    # Both parts empty (-inf) or one infinite (+inf): shift by 0 instead, so that exp gives finite
    # weights, never inf - inf; an infinite part's weight is 1 (the other's 0) below, and its
    # exponent is 0 in the branch left out.
    top = torch.isposinf(m)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    weight = lambda x: torch.where(
        top, (x == float("inf")).to(dtype), torch.exp(torch.where(top, 0.0, x - m))
    )
    wa, wb = weight(la), weight(lb)
    total = wa + wb
    seen = total > 0  # two empty parts: out 0, lse -inf, and 1 in place of total where it is left out
    safe = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(top, float("inf"), torch.where(seen, m + torch.log(safe), float("-inf")))
    inv = torch.where(seen, 1.0 / safe, torch.zeros_like(safe))
    out = out_a.to(dtype) * (wa * inv)[..., None] + out_b.to(dtype) * (wb * inv)[..., None]
    return out.to(out_a.dtype), lse
