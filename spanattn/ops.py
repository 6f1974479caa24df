"""spanattn as torch custom ops (namespace ``spanattn``): what torch.compile and CUDA graphs see
of it. Each op is opaque to dynamo, has a fake implementation giving its outputs' shapes, and
is forward only (autograd reaching one raises).

- ``spanattn::attention(q, k, v, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables,
  block_table, handle, plan_meta, backend, scale, softcap, check_pages) -> out`` (check_pages:
  ``"deferred"``, ``"sync"`` or ``"off"``, see page_check.py) and
  ``spanattn::attention_lse(...) -> (out, lse)``: the forward over packed K/V, or a paged cache
  with ``block_table``. A plan enters as its tensors plus static metadata:

  * a device plan (DevicePlanner): ``lo, hi, cu_seqlens_q/k, seq_lens`` and its prepared
    ``tables`` (e.g. triton's tile schedule), with ``plan_meta``, a string naming its layer
    kind, capacity and table layout: the op rebuilds the plan around the tensors it receives;
  * a host plan (spanattn.plan): ``lo, hi`` and ``handle``, a one-element CPU tensor naming the
    plan (``Plan.from_handle``), through which the op reaches the rest: its lengths are host
    values that change every step, so as op constants they would recompile the graph each step,
    and rebuilt from tensors they would cost a device sync and a table build per layer; its
    offsets are views into one upload buffer at offsets that change with the batch, which
    torch.compile would guard on. CPU tensors keep a graph out of torch's own CUDA graphs,
    rightly: a host plan is not replayable.

- ``spanattn::write_kv_cache(k, v, k_cache!, v_cache!, slot_mapping, check_slots)``.

:func:`spanattn.attention` and :func:`spanattn.write_kv_cache` call these ops while
torch.compile traces them; eager calls run the same implementation without the op dispatch
(host time per call).
"""

# torch infers each op's schema from typing.Optional (every supported torch version), not X | None
# ruff: noqa: UP045
from typing import Optional

import torch

from . import api, cache, page_check
from .device_plan import DevicePlan
from .plan import Plan

Tensor = torch.Tensor


def _plan(lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, handle, plan_meta):
    if handle is not None:
        return Plan.from_handle(handle)
    return DevicePlan.from_op(lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, plan_meta)


def _forward(args, return_lse: bool):
    q, k, v, *plan_tensors, block_table, handle, meta, backend, scale, softcap, check_pages = args
    plan = _plan(*plan_tensors, handle, meta)
    out, lse = api.run(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages)
    return out.contiguous(), None if lse is None else lse.contiguous()


@torch.library.custom_op("spanattn::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor,
    hi: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seq_lens: Optional[Tensor],
    tables: list[Tensor],
    block_table: Optional[Tensor],
    handle: Optional[Tensor],
    plan_meta: str,
    backend: str,
    scale: Optional[float],
    softcap: Optional[float],
    check_pages: str = "deferred",
) -> Tensor:
    return _forward(
        (q, k, v, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, block_table, handle, plan_meta,
         backend, scale, softcap, check_pages), False,
    )[0]  # fmt: skip


@torch.library.custom_op("spanattn::attention_lse", mutates_args=())
def attention_lse_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor,
    hi: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    seq_lens: Optional[Tensor],
    tables: list[Tensor],
    block_table: Optional[Tensor],
    handle: Optional[Tensor],
    plan_meta: str,
    backend: str,
    scale: Optional[float],
    softcap: Optional[float],
    check_pages: str = "deferred",
) -> tuple[Tensor, Tensor]:
    return _forward(
        (q, k, v, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, block_table, handle, plan_meta,
         backend, scale, softcap, check_pages), True,
    )  # fmt: skip


def _fake_out(q, v):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


@attention_op.register_fake
def _(q, k, v, *plan_and_options):
    return _fake_out(q, v)


@attention_lse_op.register_fake
def _(q, k, v, *plan_and_options):
    return _fake_out(q, v), q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("spanattn::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def write_kv_cache_op(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, check_slots: Optional[bool]
) -> None:
    cache.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, check_slots=check_slots)


@write_kv_cache_op.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, check_slots):
    return None


def _forward_only(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"spanattn::{name} is forward only (no backward yet); run it under torch.no_grad() or "
            "torch.inference_mode(), or detach its inputs"
        )

    return backward


for _op, _name in ((attention_op, "attention"), (attention_lse_op, "attention_lse")):
    _op.register_autograd(_forward_only(_name), setup_context=lambda ctx, inputs, output: None)


def attention_call(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages=True):
    """:func:`spanattn.attention` while torch.compile traces it: the checks that read only
    tensor shapes, then the op (the rest of the checks run inside it)."""
    api.check_tensors(q, k, v, plan, block_table)
    how = page_check.mode(check_pages)  # a string in the op's schema: "deferred", "sync" or "off"
    if isinstance(plan, Plan):
        lengths, tables, handle, meta = (None, None, None), [], plan.handle, ""
    else:
        lengths = (plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens)
        tables, handle, meta = plan.op_tables, None, plan.op_meta
    args = (q, k, v, plan.lo, plan.hi, *lengths, tables, block_table, handle, meta, backend, scale, softcap,
            how)  # fmt: skip
    if return_lse:
        return attention_lse_op(*args)
    return attention_op(*args)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, check_slots: bool | None = None) -> None:
    """Write this step's ``k, v [tokens, Hkv, D]`` into ``k_cache, v_cache [num_blocks,
    block_size, Hkv, D]`` in place, row ``t`` at flat slot ``slot_mapping[t]``; negative slots are
    skipped (padding tokens, as in vLLM). Under torch.compile, the op ``spanattn::write_kv_cache``.

    check_slots: verify every slot is ``< num_blocks * block_size``. It reads the slots on the
        host, a GPU sync, so the default does it except on CUDA while a graph is being captured.
    """
    if torch.compiler.is_compiling():
        write_kv_cache_op(k, v, k_cache, v_cache, slot_mapping, check_slots)
    else:
        cache.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, check_slots=check_slots)
