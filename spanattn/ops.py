"""spanattn as torch custom ops (namespace ``spanattn``): what torch.compile and CUDA graphs see
of it. Each op is opaque to dynamo and has a fake implementation giving its outputs' shapes. The
attention ops train (their autograd: grad.py, through ``spanattn::attention_backward`` for a host
plan, ``spanattn::attention_backward_device_plan`` for a device plan's, which CUDA graphs may
record like its forward).

- ``spanattn::attention(q, k, v, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables,
  block_table, handle, plan_meta, backend, scale, softcap, check_pages) -> out`` (check_pages:
  ``"deferred"``, ``"sync"`` or ``"off"``, see page_check.py) and
  ``spanattn::attention_lse(...) -> (out, lse)``: the forward over packed K/V, or a paged cache
  with ``block_table``. A plan enters as its tensors plus static metadata:

  * a device plan (DevicePlanner): ``lo, hi, cu_seqlens_q/k, seq_lens`` and its prepared
    ``tables`` (e.g. triton's tile schedule), with ``plan_meta``, a string naming its layer
    kind, capacity and table layout: the op rebuilds the plan around the tensors it receives;
  * a host plan (spanattn.plan): ``lo, hi`` and ``handle``, a one-element CPU tensor naming the
    plan (``Plan._from_handle``), through which the op reaches the rest: its lengths are host
    values that change every step, so as op constants they would recompile the graph each step,
    and rebuilt from tensors they would cost a device sync and a table build per layer; its
    offsets are views into one upload buffer at offsets that change with the batch, which
    torch.compile would guard on. A host plan is not replayable: its steps call
    ``spanattn::attention_host_plan`` and ``attention_lse_host_plan`` (the same arguments),
    which torch's CUDA graphs never record (inductor runs them between its graphs).

- ``spanattn::write_kv_cache(k, v, k_cache!, v_cache!, slot_mapping, check_slots)``.

:func:`spanattn.attention` and :func:`spanattn.write_kv_cache` call these ops while
torch.compile traces them; eager calls run the same implementation without the op dispatch
(host time per call).
"""

# torch infers write_kv_cache's schema from typing.Optional (every supported torch version), not X | None
# ruff: noqa: UP045
from typing import Optional

import torch

from . import cache, page_check
from .backends.dense import lse_dtype
from .device_plan import DevicePlan
from .dispatch import check_tensors, check_trainable, needs_grad, run
from .grad import register_autograd
from .plan import Plan

Tensor = torch.Tensor


def _plan(lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, handle, plan_meta):
    if handle is not None:
        return Plan._from_handle(handle)
    return DevicePlan._from_op(lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, plan_meta)


def full_args(args) -> tuple:
    """An op call's arguments with its defaults: torch passes the implementation a defaulted
    argument only where the op's caller gave it."""
    given = len(args) - (_N_ARGS - len(_DEFAULTS))  # how many of the defaulted ones the caller gave
    return (*args, *_DEFAULTS[given:])


def _forward(args, return_lse: bool):
    q, k, v, *plan_tensors, block_table, handle, meta, backend, scale, softcap, pages, grad = full_args(args)
    plan = _plan(*plan_tensors, handle, meta)
    out, lse = run(q, k, v, plan, block_table, backend, scale, softcap, return_lse, pages,
                   "op" if grad else None)  # fmt: skip
    return out.contiguous(), None if lse is None else lse.contiguous()


# The attention ops' arguments (both plan kinds; see the module docstring); grad: the call will
# be differentiated through the op's autograd (grad.py), so its backend must have a backward.
_DEFAULTS = ("deferred", False)
_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "Tensor? seq_lens, Tensor[] tables, Tensor? block_table, Tensor? handle, str plan_meta, str backend, "
    f'float? scale, float? softcap, str check_pages="{_DEFAULTS[0]}", bool grad=False'
)
_N_ARGS = _ARGS.count(",") + 1
# A host plan's step is not replayable: its kernels' arguments (tile tables, lengths, item counts)
# come from the plan the handle names at call time. Without this tag inductor's graph partitions
# (on by default in recent torch) would record the op in its CUDA graphs and replay the first step's
# plan for every later one; tagged, the op runs outside them. Older torch keeps any graph with a
# CPU input (the handle) out of its CUDA graphs, and has no such tag.
_NOT_REPLAYABLE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _fake_out(q, v):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


def _fake_lse(q, v):
    return _fake_out(q, v), q.new_empty((q.shape[0], q.shape[1]), dtype=lse_dtype(q))


def _attention_op(name: str, with_lse: bool, tags: tuple = (), lse_op=None):
    """The op ``spanattn::<name>``: ``out``, or ``(out, lse)``, with its gradients (grad.py;
    ``lse_op``: the op whose LSE an op without one recomputes for its backward)."""
    returns = "(Tensor, Tensor)" if with_lse else "Tensor"

    def forward(*args):
        out, lse = _forward(args, with_lse)
        return (out, lse) if with_lse else out

    op = torch.library.custom_op(
        f"spanattn::{name}", forward, mutates_args=(), schema=f"({_ARGS}) -> {returns}",
        **({"tags": tags} if tags else {}),
    )  # fmt: skip
    op.register_fake(lambda q, k, v, *plan_and_options: (_fake_lse if with_lse else _fake_out)(q, v))
    register_autograd(op, with_lse, full_args, lse_op)
    return op


# Device plans (replayable: CUDA graphs may record them) and host plans (never recorded).
attention_lse_op = _attention_op("attention_lse", True)
attention_op = _attention_op("attention", False, lse_op=attention_lse_op)
host_attention_lse_op = _attention_op("attention_lse_host_plan", True, _NOT_REPLAYABLE)
host_attention_op = _attention_op("attention_host_plan", False, _NOT_REPLAYABLE, lse_op=host_attention_lse_op)


@torch.library.custom_op("spanattn::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache_op(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, check_slots: Optional[bool]
) -> None:
    cache.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, check_slots=check_slots)


@write_kv_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, check_slots):
    return None


def attention_call(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages=True):
    """:func:`spanattn.attention` while torch.compile traces it: the checks that read only
    tensor shapes, then the op (the rest of the checks run inside it)."""
    check_tensors(q, k, v, plan, block_table)
    grad = needs_grad(q, k, v)
    if grad:  # refused here already (under torch.compile: while tracing), not at the op's first run
        check_trainable(plan, block_table)
    how = page_check.mode(check_pages)  # a string in the op's schema: "deferred", "sync" or "off"
    host = isinstance(plan, Plan)
    if host:
        lengths, tables, handle, meta = (None, None, None), [], plan.handle, ""
    else:
        lengths = (plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens)
        tables, handle, meta = plan.op_tables, None, plan.op_meta
    args = (q, k, v, plan.lo, plan.hi, *lengths, tables, block_table, handle, meta, backend, scale, softcap,
            how)  # fmt: skip
    if grad:  # the LSE is what the backward needs besides the output: always the _lse op
        out, lse = (host_attention_lse_op if host else attention_lse_op)(*args, True)
        return (out, lse) if return_lse else out
    if return_lse:
        return (host_attention_lse_op if host else attention_lse_op)(*args)
    return (host_attention_op if host else attention_op)(*args)


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    check_slots: bool | None = None,
) -> None:
    """Write this step's ``k, v [tokens, Hkv, D]`` into ``k_cache, v_cache [num_blocks,
    block_size, Hkv, D]`` in place, row ``t`` at flat slot ``slot_mapping[t]``; negative slots are
    skipped (padding tokens, as in vLLM). Under torch.compile, the op ``spanattn::write_kv_cache``.

    check_slots: verify every slot is ``< num_blocks * block_size`` and no two tokens name one.
        It reads the slots on the host, a GPU sync, so the default does it except on CUDA while
        a graph is being captured. The layout and aliasing rules: :func:`spanattn.cache.write_kv_cache`.
    """
    if torch.compiler.is_compiling():
        write_kv_cache_op(k, v, k_cache, v_cache, slot_mapping, check_slots)
    else:
        cache.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, check_slots=check_slots)
