"""attention(): the public call. Eager calls run dispatch.py's checks, backend choice and
forward; under torch.compile, and where gradients come from a backend's own backward, the call
is one opaque torch op (ops.py) whose implementation is that same eager path."""

from __future__ import annotations

import torch

from .device_plan import DevicePlan
from .dispatch import needs_grad, resolve, run
from .ops import attention_call
from .plan import Plan


def _autocast(q) -> bool:
    """Is autocast on for q's device? Then float32 q, k, v run in the autocast dtype (SDPA is on
    autocast's list of ops that run in it; autograd's casts carry the gradients back to float32)
    and the backends compute with autocast off: their own precision choices hold."""
    return torch.is_tensor(q) and torch.is_autocast_enabled(q.device.type)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan | DevicePlan,
    *,
    block_table: torch.Tensor | None = None,
    backend: str = "auto",
    scale: float | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    check_pages: bool | str = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed varlen ``q [total_q, Hq, D]`` over ``k, v [total_k, Hkv, D]`` under the
    plan's mask. Returns ``out [total_q, Hq, D]`` (q's dtype), and with ``return_lse=True`` also
    ``lse [total_q, Hq]`` (fp32, natural log of the softmax denominator, scale applied).

    plan: from :func:`spanattn.plan`, or a device plan (:class:`spanattn.DevicePlanner`): then
        ``q`` has the planner's ``max_tokens`` rows and packed ``k, v`` at least its
        ``max_kv_tokens``; backends fa4 and flex refuse device plans.
    block_table: int32 ``[num_seqs, max_blocks]``; then ``k, v`` are paged caches
        ``[num_blocks, block_size, Hkv, D]`` (block_size 16, 32, 64, 128 or 256) and key ``pos``
        of sequence ``r`` (its first ``kv_len`` in the plan) sits at block
        ``block_table[r, pos // block_size]``, offset ``pos % block_size``. Write the step's new
        keys first (:func:`spanattn.write_kv_cache`).
    check_pages: every block a sequence reads must exist (``0 <= id < num_blocks``), checked
        once per plan and table (page_check.py); a bad entry raises IndexError naming the
        sequence, the entry and its value. ``True`` (default; also ``"deferred"``): a CUDA table
        is checked on the device with no host sync, and a later step's first call (or
        :func:`spanattn.check_pending_pages`) raises, saying which earlier step it was; a CPU
        table at once. ``"sync"``: before this call runs (on CUDA a host sync). ``False`` (also
        ``"off"``): not checked, for engines that validate their tables. Every kernel clamps
        block ids into the cache, so a bad table never reads outside it: the step that carries
        it gives that sequence a wrong output and leaves the others untouched. Not checked
        while a CUDA graph is captured, nor with a device plan (the engine's tables).
    backend: ``"auto"`` takes the first that can run this call of fa4 (CUDA, FlashAttention-4
        installed, head_dim <= 256), triton (CUDA), sdpa, reference, skipping one that declines
        a step another runs better (fa4 leaves decode-shaped and ragged steps to triton, and on
        Hopper the span steps triton's Gluon kernels run faster);
        a backend named explicitly runs or raises, never falls back. :func:`spanattn.auto_choice`
        names the backend ``"auto"`` runs for a call.
    scale: softmax scale, default ``1 / sqrt(D)``. softcap: Gemma-2-style ``c * tanh(s / c)``.

    Gradients: when q, k or v requires grad (and grad mode is on), the output (and the LSE)
    carry gradients to q, k and v, from the backend's backward (``auto`` takes one that has
    it), or the call raises naming a backend that trains it; never an output without them.
    Saved for the backward: q, k, v, the output and its LSE. A paged cache does not train; a
    device plan does (packed K/V; its backward plans on the device, from a copy of the plan's
    tensors taken by the forward: the planner's next update may come first). Under autocast,
    float32 q, k, v are cast to the autocast dtype, as SDPA's are.

    Under ``torch.compile`` this is the op ``torch.ops.spanattn.attention`` (ops.py): no graph
    break, and nothing of a host plan's lengths becomes a guard; gradients flow through it
    (grad.py).

    >>> import torch, spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5, spans=[(2, 4)])]), sa.LayerMask())
    >>> q = torch.randn(3, 2, 16); k = v = torch.randn(5, 1, 16)
    >>> sa.attention(q, k, v, p).shape
    torch.Size([3, 2, 16])
    """
    if _autocast(q):
        device = q.device.type
        dtype = torch.get_autocast_dtype(device)
        cast = lambda t: t.to(dtype) if torch.is_tensor(t) and t.dtype == torch.float32 else t
        with torch.autocast(device, enabled=False):
            return attention(cast(q), cast(k), cast(v), plan, block_table=block_table, backend=backend,
                             scale=scale, softcap=softcap, return_lse=return_lse,
                             check_pages=check_pages)  # fmt: skip
    grad = "eager" if needs_grad(q, k, v) else None
    if grad is not None and not torch.compiler.is_compiling():
        mod, _ = resolve(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages, grad)
        if not getattr(mod, "NATIVE_AUTOGRAD", False):
            grad = "op"  # its gradients come from its own backward, through the op's autograd
    if torch.compiler.is_compiling() or grad == "op":
        return attention_call(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages)
    out, lse = run(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages, grad)
    return (out, lse) if return_lse else out
