"""attention(): check the tensors against the plan, pick a backend, run it."""

from __future__ import annotations

import inspect
import math

import torch

from . import backends
from .cache import check_paged, checked_once
from .plan import Plan

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
AUTO_ORDER = ("fa4", "triton", "sdpa", "reference")


def _check(q, k, v, plan: Plan, block_table=None, check_pages: bool = True) -> None:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a spanattn.Plan (from spanattn.plan), got {type(plan).__name__}")
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if paged and name != "q":
            if t.dim() != 4:
                raise ValueError(
                    f"{name} must be a paged cache [num_blocks, block_size, kv_heads, head_dim] "
                    f"with a block_table, got shape {tuple(t.shape)}"
                )
        elif t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype must be one of float16/bfloat16/float32, got {t.dtype}")
        if t.device != plan.device:
            raise ValueError(
                f"{name} is on {t.device} but the plan is on {plan.device}; plan on the same device"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[0] != plan.total_q:
        raise ValueError(f"q has {q.shape[0]} tokens but the plan packs {plan.total_q} queries")
    if paged:
        check_paged(k, v, block_table, plan, names=("k", "v"))
        if check_pages:
            checked_once(block_table, plan, k.shape[0], k.shape[1])
    elif k.shape[0] != plan.total_k or v.shape[0] != plan.total_k:
        raise ValueError(
            f"k and v must have the plan's {plan.total_k} packed keys, got {k.shape[0]} and {v.shape[0]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[-2]} and {v.shape[-2]}")
    if q.shape[1] % k.shape[-2]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[-2]}) for GQA")
    if q.shape[2] != k.shape[-1] or v.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v must share head_dim, got {q.shape[2]}, {k.shape[-1]}, {v.shape[-1]}")


def _unavailable(mod, q, plan: Plan, opts: dict) -> str | None:
    # A backend takes a paged cache only if its forward has a block_table parameter.
    if "block_table" in opts and "block_table" not in inspect.signature(mod.forward).parameters:
        return "it reads only packed K/V, not a paged cache (block_table)"
    return mod.unavailable(q, plan, **opts)


def attention(
    q,
    k,
    v,
    plan: Plan,
    *,
    block_table=None,
    backend: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    check_pages: bool = True,
):
    """Attention of packed varlen ``q [total_q, Hq, D]`` over ``k, v [total_k, Hkv, D]`` under the
    plan's mask. Returns ``out [total_q, Hq, D]`` (q's dtype), and with ``return_lse=True`` also
    ``lse [total_q, Hq]`` (fp32, natural log of the softmax denominator, scale applied).

    block_table: int32 ``[num_seqs, max_blocks]``; then ``k, v`` are paged caches
        ``[num_blocks, block_size, Hkv, D]`` (block_size 16, 32, 64, 128 or 256) and key ``pos``
        of sequence ``r`` (its first ``kv_len`` in the plan) sits at block
        ``block_table[r, pos // block_size]``, offset ``pos % block_size``. Write the step's new
        keys first (:func:`spanattn.write_kv_cache`).
    check_pages: verify that every block a sequence reads exists (``0 <= id < num_blocks``) and
        raise an error naming the sequence and entry otherwise. On CUDA this reads the table
        once per step (plan and table contents), one host sync, and never while a CUDA graph is
        captured; engines that validate their tables themselves pass False. Unchecked, a bad id
        reads whatever memory it points to.

    backend: ``"auto"`` takes the first that can run this call of fa4 (CUDA, FlashAttention-4
        installed, head_dim <= 256), triton (CUDA), sdpa, reference, skipping one that declines
        a step another runs better (fa4 leaves decode-shaped and ragged span steps to triton);
        a backend named explicitly runs or raises, never falls back.
    scale: softmax scale, default ``1 / sqrt(D)``. softcap: Gemma-2-style ``c * tanh(s / c)``.

    >>> import torch, spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5, spans=[(2, 4)])]), sa.LayerMask())
    >>> q = torch.randn(3, 2, 16); k = v = torch.randn(5, 1, 16)
    >>> sa.attention(q, k, v, p).shape
    torch.Size([3, 2, 16])
    """
    _check(q, k, v, plan, block_table, check_pages)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    opts = {"scale": scale, "softcap": softcap, "return_lse": return_lse}
    if block_table is not None:
        opts["block_table"] = block_table
    if backend == "auto":
        reasons = []
        for name in AUTO_ORDER:
            if name not in backends.BACKENDS:
                continue
            mod = backends.load(name)
            if getattr(mod, "AUTO_NEEDS_CUDA", False) and q.device.type != "cuda":
                continue  # e.g. triton's interpreter: correct but far too slow to pick unasked
            why = _unavailable(mod, q, plan, opts)
            if why is None and hasattr(mod, "auto_declines"):  # could run, another suits better
                why = mod.auto_declines(q, plan, **opts)
            if why is None:
                break
            reasons.append(f"{name}: {why}")
        else:
            raise RuntimeError("no backend can run this call: " + "; ".join(reasons))
    else:
        mod = backends.load(backend)
        why = _unavailable(mod, q, plan, opts)
        if why is not None:
            raise RuntimeError(f"backend={backend!r} cannot run this call: {why}")
    out, lse = mod.forward(q, k, v, plan, **opts)
    return (out, lse) if return_lse else out
