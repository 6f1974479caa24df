"""What the benchmark runs: spanattn's backends and the peers users would run instead.

Each item says why it cannot run a case (or None), builds the timed callable for a plan and
inputs (one-time preparation outside the timing), and says what one step pays to plan.
``exact`` peers compute the scenario's mask and are checked; speed-of-light peers (FA4's
built-in causal/window on a layer with spans) compute a simpler mask and are not.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import spanattn as sa
from spanattn import backends


@dataclass(frozen=True)
class Item:
    name: str
    kind: str  # "spanattn" or "peer"
    unavailable: Callable  # (scenario, plan, q) -> str | None
    make: Callable  # (plan, q, k, v, scale) -> () -> out [total_q, Hq, D]
    planning: Callable | None  # (scenario, device, head_dim) -> () -> None, one step's planning
    exact: Callable = lambda sc: True  # does it compute the scenario's mask?
    note: str | None = None


def backend_item(name: str) -> Item:
    mod = backends.load(name)
    prepare = getattr(mod, "prepare", None)  # a backend's per-plan tables, if it has any

    def make(plan, q, k, v, scale):
        if prepare is not None:
            prepare(plan, q.shape[-1])
        return lambda: mod.forward(q, k, v, plan, scale=scale)[0]

    def planning(sc, device, head_dim):
        def step():
            p = sa.plan(sc.batch, sc.layer, device)
            if prepare is not None:
                prepare(p, head_dim)

        return step

    # without prepare() planning counts spanattn.plan only; the row says so
    note = None if prepare else "planning = spanattn.plan only (the backend has no prepare())"
    unavailable = lambda sc, plan, q: mod.unavailable(q, plan, scale=1.0)
    return Item(name, "spanattn", unavailable, make, planning, note=note)


def _interval_mask_mod(plan):
    """The plan's mask over the packed step as a ``mask_mod``: the flex backend's (intervals, and
    span groups where the plan has them)."""
    from spanattn.backends.flex import mask_mod

    g = plan.groups
    return mask_mod(*plan.packed_intervals(), *(() if g is None else (g.q_group, g.k_group, g.clamp)))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # what attention-gym and the docs do


def _flex_cbm_unavailable(sc, plan, q):
    from spanattn.backends import flex

    return flex.unavailable(q, plan)


def _flex_cbm_make(plan, q, k, v, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(
        _interval_mask_mod(plan), None, None, plan.total_q, plan.total_k, device=q.device
    )
    run = _compiled_flex() if q.is_cuda else flex_attention
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    return lambda: run(q4, k4, v4, block_mask=block_mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def _flex_cbm_planning(sc, device, head_dim, compiled=False):
    """The peer's per-step cost: ``create_block_mask`` over the same interval ``mask_mod`` (the
    per-token intervals it reads are given to it for free)."""
    from torch.nn.attention.flex_attention import create_block_mask

    plan = sa.plan(sc.batch, sc.layer, device)
    mask_mod = _interval_mask_mod(plan)
    kw = {"_compile": True} if compiled else {}
    return lambda: create_block_mask(mask_mod, None, None, plan.total_q, plan.total_k, device=device, **kw)


def _plain_causal(sc) -> bool:
    """Every sequence causal, no window, no active span, no cached prefix: a built-in causal mask
    is the scenario's mask."""
    no_spans = sc.layer.spans == "off" or not any(s.spans for s in sc.batch.seqs)
    return (
        no_spans and sc.layer.window is None and all(s.causal and s.q_len == s.kv_len for s in sc.batch.seqs)
    )


def _sdpa_unavailable(sc, plan, q):
    if not _plain_causal(sc):
        return "SDPA's built-in causal mask cannot express this layer (spans, window, prefix or flags)"
    return None


def _sdpa_efficient_unavailable(sc, plan, q):
    if q.shape[-1] <= 256:
        return "flash runs head_dim <= 256 (sdpa-flash-causal); this peer is for larger ones"
    return _sdpa_unavailable(sc, plan, q)


def _sdpa_maker(backend: str):
    """SDPA's built-in causal mask per sequence on one of its CUDA kernels, never a silent
    fallback to another: ``flash`` (head_dim <= 256, GQA native) or ``efficient`` (any head_dim;
    no GQA, so the K/V heads are repeated once, outside the timed call)."""

    def make(plan, q, k, v, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
        gqa = backend == "flash"
        if not gqa:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        cu_k = plan.cu_seqlens_k.tolist()
        parts = [(plan.seq_slice(i), slice(cu_k[i], cu_k[i + 1])) for i in range(plan.num_seqs)]

        def run():
            ctx = sdpa_kernel([kernel]) if q.is_cuda else contextlib.nullcontext()
            with ctx:
                outs = [
                    F.scaled_dot_product_attention(
                        *(x.transpose(0, 1)[None] for x in (q[r], k[c], v[c])),
                        is_causal=True,
                        scale=scale,
                        enable_gqa=gqa,
                    )[0].transpose(0, 1)
                    for r, c in parts
                ]
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return run

    return make


def _fa4_unavailable(sc, plan, q):
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # optional peer: any import failure means "not here"
        return f"flash_attn.cute does not import ({type(e).__name__})"
    if not q.is_cuda or q.shape[-1] > 256:
        return "FA4 needs CUDA and head_dim <= 256 on SM90"
    if not all(s.causal for s in sc.batch.seqs):
        return "FA4's built-in masks have no per-sequence causal flag"
    return None


def _fa4_make(plan, q, k, v, scale):
    from flash_attn.cute import flash_attn_varlen_func

    w = plan.layer.window
    window = (None, None) if w is None else (w - 1, 0)

    def run():
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def items(names=None) -> list[Item]:
    """Every registered backend but the reference (the oracle), then the peers."""
    out = [backend_item(n) for n in backends.BACKENDS if n != "reference"]
    out += [
        Item("flex+create_block_mask", "peer", _flex_cbm_unavailable, _flex_cbm_make, _flex_cbm_planning),
        Item("sdpa-flash-causal", "peer", _sdpa_unavailable, _sdpa_maker("flash"), None),
        Item("sdpa-efficient-causal", "peer", _sdpa_efficient_unavailable, _sdpa_maker("efficient"), None),
        Item("fa4-builtin", "peer", _fa4_unavailable, _fa4_make, None, exact=_plain_causal),
    ]
    return [i for i in out if names is None or i.name in names]
