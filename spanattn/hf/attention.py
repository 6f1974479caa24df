"""The ``AttentionInterface`` entry: transformers' ``[B, H, S, D]`` attention call computed by
:func:`spanattn.attention` on packed varlen rows, under the :class:`StepMask` of its layer kind
(under torch.compile: on the cache's own layout, :mod:`spanattn.hf.static`)."""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

import spanattn as sa

from . import static
from .options import NAME, options_of
from .packing import check_flash_kwargs
from .step import StepMask

# Attention classes whose model calls them without a mask when nothing is padded, meaning every
# key: DiffusionGemma's decoder canvas over the prefix its layer keeps plus the canvas.
UNMASKED_CANVASES = ("DiffusionGemmaDecoderTextAttention",)


def _pack(x: torch.Tensor, ranges: list[tuple[int, int, int]]) -> torch.Tensor:
    """``[B, H, S, D]`` to varlen ``[tokens, H, D]``: batch row ``row``'s indices ``[a, b)`` for
    each ``(row, a, b)`` in order. Ranges that tile every row (no padding: one sequence per row, or
    a packed row's samples) are a reshape, one range of a one-row batch a strided view: no copy
    (backends take any token and head strides)."""
    b, h, s, d = x.shape
    if b == 1 and len(ranges) == 1:
        _, a, z = ranges[0]
        return x[0, :, a:z].transpose(0, 1)
    if sum(z - a for _, a, z in ranges) == b * s:
        return x.transpose(1, 2).reshape(b * s, h, d)
    return torch.cat([x[row, :, a:z].transpose(0, 1) for row, a, z in ranges])


def _not_ours(module, query, key, value, attention_mask, **kwargs):
    """Layers spanattn does not run (encoders: vision and audio towers) keep transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Same contract as transformers' eager attention; returns ``(out [B, S, Hq, D], None)``."""
    b, _, sq, _ = query.shape
    sk = key.shape[2]
    step = attention_mask
    if not isinstance(step, StepMask):
        if step is None and type(module).__name__ in UNMASKED_CANVASES:
            step = StepMask.every_key(b, sq, sk, options_of(module.config))
        elif not kwargs.get("is_causal", getattr(module, "is_causal", True)):
            return _not_ours(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        else:
            raise TypeError(
                f"attn_implementation={NAME!r} builds its own mask from the 2D attention_mask; "
                f"{type(module).__name__} got {type(attention_mask).__name__} (a prepared 4D mask?)"
            )
    if dropout and module.training:
        raise NotImplementedError("spanattn.hf has no attention dropout")
    if is_compiling():  # shapes fixed by the cache, plan read as tensors: nothing host-side traced
        return static.forward(step, query, key, value, scaling, kwargs.get("softcap"))
    plan, rows = step.plan(sq, sk, query.device)
    if plan is None:  # only padding queries: their output is zero
        return query.new_zeros(b, sq, query.shape[1], value.shape[3]), None
    check_flash_kwargs(step, rows, b * sq, kwargs)
    q = _pack(query, [(r.row, r.q0, r.q1) for r in rows])
    k, v = (_pack(x, [(r.row, r.k0, r.k1) for r in rows]) for x in (key, value))
    o = sa.attention(
        q, k, v, plan, backend=step.options.backend, scale=scaling, softcap=kwargs.get("softcap")
    )
    if o.shape[0] == b * sq:  # every query planned, in order
        return o.view(b, sq, *o.shape[1:]), None
    out, start = query.new_zeros(b, sq, *o.shape[1:]), 0
    for r in rows:
        out[r.row, r.q0 : r.q1] = o[start : start + r.q1 - r.q0]
        start += r.q1 - r.q0
    return out, None
