"""Gradients through spanattn's torch ops: the autograd formulas of the attention ops (ops.py)
and the ops they call, ``spanattn::attention_backward(dout, dlse, q, k, v, out, lse, handle,
backend, scale, softcap) -> (dq, dk, dv)`` for a host plan and
``spanattn::attention_backward_device_plan`` (the device plan's tensors and encoding instead of
a handle) for a device plan, opaque to torch.compile like the forward (no graph break, nothing of
a plan's lengths a guard).

Saved for the backward: q, k, v, the output and its LSE, and the plan (its handle, or copies of
a device plan's tensors, O(tokens): the planner's next update rewrites the plan in place, and a
step's backward may run after it, as under gradient accumulation); nothing O(q x kv). The
backward runs the backend the forward ran (the same choice from the same call:
``dispatch.pick`` with ``grad="op"``), through its own
``backward`` (the triton kernels, the dense formulas of reference and sdpa). The LSE's own
gradient (``attention_lse``) enters it as ``dlse``. The op without an LSE output recomputes the
LSE in its backward (spanattn.attention calls the ``_lse`` op whenever its inputs require grad,
so only direct op calls pay for it). A device plan's backward, like its forward, reads nothing
on the host: CUDA graphs may record it."""

from __future__ import annotations

import math

import torch

from .device_plan import DevicePlan
from .dispatch import pick
from .plan import Plan

# Host plans are not replayable, so neither is their backward (ops.py's _NOT_REPLAYABLE).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _backward(dout, dlse, q, k, v, out, lse, plan, backend, scale, softcap):
    mod = pick(q, plan, backend, {"softcap": softcap, "return_lse": True, "grad": "op"})
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dq, dk, dv = mod.backward(q, k, v, out, lse, dout, plan, scale=scale, softcap=softcap, dlse=dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _host_backward(dout, dlse, q, k, v, out, lse, handle, backend, scale, softcap):
    return _backward(dout, dlse, q, k, v, out, lse, Plan._from_handle(handle), backend, scale, softcap)


def _device_backward(dout, dlse, q, k, v, out, lse, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables,
                     plan_meta, backend, scale, softcap):  # fmt: skip
    plan = DevicePlan._from_op(lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, plan_meta)
    return _backward(dout, dlse, q, k, v, out, lse, plan, backend, scale, softcap)


_GRADS = "Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse"
_OPTIONS = "str backend, float? scale, float? softcap) -> (Tensor, Tensor, Tensor)"


def _fake_grads(dout, dlse, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


backward_op = torch.library.custom_op(
    "spanattn::attention_backward", _host_backward, mutates_args=(),
    schema=f"({_GRADS}, Tensor handle, {_OPTIONS}", **({"tags": _TAGS} if _TAGS else {}),
)  # fmt: skip
backward_op.register_fake(_fake_grads)
device_backward_op = torch.library.custom_op(
    "spanattn::attention_backward_device_plan", _device_backward, mutates_args=(),
    schema=f"({_GRADS}, Tensor lo, Tensor hi, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor seq_lens, "
    f"Tensor[] tables, str plan_meta, {_OPTIONS}",
)  # fmt: skip
device_backward_op.register_fake(_fake_grads)


def _live_plan(handle):
    """The plan behind a real (not traced) handle, so that the autograd graph keeps it alive until
    its backward; None while torch.compile traces (the caller keeps a compiled step's plan)."""
    if type(handle) is torch.Tensor and handle.device.type == "cpu":
        return Plan._from_handle(handle)
    return None


def register_autograd(op, with_lse: bool, full_args, lse_op=None) -> None:
    """Give an attention op (ops.py) its gradients with respect to q, k and v. full_args: the
    op's arguments with its defaults (``ops.full_args``); lse_op: for an op without an LSE
    output, the op of the same plan kind that recomputes it."""

    def setup_context(ctx, inputs, output):
        q, k, v, lo, hi, cu_q, cu_k, seq_lens, tables, _pages, handle, meta, backend, scale, softcap, *_ = (
            full_args(inputs)
        )
        out, lse = output if with_lse else (output, None)
        if handle is not None:
            plan = (lo, hi, handle)
        else:  # copies: the planner's next update rewrites its tensors before this backward may run
            plan = tuple(t.clone() for t in (lo, hi, cu_q, cu_k, seq_lens, *tables))
        ctx.save_for_backward(q, k, v, out, lse, *plan)
        ctx.options = (backend, scale, softcap)
        ctx.meta = None if handle is not None else meta
        ctx.plan = _live_plan(handle)

    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, lo, hi, *plan = ctx.saved_tensors
        if ctx.meta is None:  # a host plan: its handle
            plan_args = (lo, hi, None, None, None, [], None, plan[0], "")
        else:  # a device plan: its lengths, tables and encoding
            plan_args = (lo, hi, *plan[:3], plan[3:], None, None, ctx.meta)
        if lse is None:  # the op without an LSE output: recompute it (the same bits as its output)
            out, lse = lse_op(q, k, v, *plan_args, *ctx.options, "off", True)
        if dout is None:
            dout = torch.zeros_like(out)
        if ctx.meta is None:
            dq, dk, dv = backward_op(dout, dlse, q, k, v, out, lse, plan[0], *ctx.options)
        else:
            dq, dk, dv = device_backward_op(
                dout, dlse, q, k, v, out, lse, lo, hi, *plan[:3], plan[3:], ctx.meta, *ctx.options
            )
        # one gradient per input as the op was called (defaults left out), a list for the tables
        rest = ([None] * len(x) if isinstance(x, (list, tuple)) else None for x in ctx.needs_input_grad[3:])
        return (dq, dk, dv, *rest)

    op.register_autograd(backward, setup_context=setup_context)
