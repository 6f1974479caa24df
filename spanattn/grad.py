"""Gradients through spanattn's torch ops: the autograd formulas of the host-plan attention ops
(``spanattn::attention_host_plan`` and ``attention_lse_host_plan``, ops.py) and the op they call,
``spanattn::attention_backward(dout, dlse, q, k, v, out, lse, handle, backend, scale, softcap)
-> (dq, dk, dv)``, opaque to torch.compile like the forward (no graph break, nothing of a plan's
lengths a guard).

Saved for the backward: q, k, v, the output and its LSE, and the plan's handle; nothing
O(q x kv). The backward runs the backend the forward ran (the same choice from the same call:
``dispatch.pick`` with ``grad="op"``), through its own ``backward`` (the triton kernels, the dense
formulas of reference and sdpa). The LSE's own gradient (``attention_lse``) enters it as
``dlse``. The op without an LSE output recomputes the LSE in its backward (spanattn.attention
calls the ``_lse`` op whenever its inputs require grad, so only direct op calls pay for it).

Device plans serve and do not train: their ops stay forward only (ops.py)."""

from __future__ import annotations

import math

import torch

from .dispatch import pick
from .plan import Plan

# Host plans are not replayable, so neither is their backward (ops.py's _NOT_REPLAYABLE).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _backward_impl(dout, dlse, q, k, v, out, lse, handle, backend, scale, softcap):
    plan = Plan._from_handle(handle)
    mod = pick(q, plan, backend, {"softcap": softcap, "return_lse": True, "grad": "op"})
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dq, dk, dv = mod.backward(q, k, v, out, lse, dout, plan, scale=scale, softcap=softcap, dlse=dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


backward_op = torch.library.custom_op(
    "spanattn::attention_backward",
    _backward_impl,
    mutates_args=(),
    schema="(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor handle, "
    "str backend, float? scale, float? softcap) -> (Tensor, Tensor, Tensor)",
    **({"tags": _TAGS} if _TAGS else {}),
)
backward_op.register_fake(lambda dout, dlse, q, k, v, *rest: (torch.empty_like(q), torch.empty_like(k),
                                                               torch.empty_like(v)))  # fmt: skip


def _live_plan(handle):
    """The plan behind a real (not traced) handle, so that the autograd graph keeps it alive until
    its backward; None while torch.compile traces (the caller keeps a compiled step's plan)."""
    if type(handle) is torch.Tensor and handle.device.type == "cpu":
        return Plan._from_handle(handle)
    return None


def register_autograd(op, with_lse: bool, full_args, lse_op=None) -> None:
    """Give a host-plan attention op (ops.py) its gradients with respect to q, k and v.
    full_args: the op's arguments with its defaults (``ops.full_args``); lse_op: for an op
    without an LSE output, the op that recomputes it (``attention_lse_host_plan``)."""

    def setup_context(ctx, inputs, output):
        q, k, v, lo, hi, *_, handle, _meta, backend, scale, softcap, _pages, _grad = full_args(inputs)
        out, lse = output if with_lse else (output, None)
        ctx.save_for_backward(q, k, v, lo, hi, handle, out, lse)
        ctx.options = (backend, scale, softcap)
        ctx.plan = _live_plan(handle)

    def backward(ctx, dout, dlse=None):
        q, k, v, lo, hi, handle, out, lse = ctx.saved_tensors
        backend, scale, softcap = ctx.options
        if lse is None:  # the op without an LSE output: recompute it (the same bits as its output)
            out, lse = lse_op(q, k, v, lo, hi, None, None, None, [], None, handle, "", backend, scale,
                              softcap, "off", True)  # fmt: skip
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_op(dout, dlse, q, k, v, out, lse, handle, backend, scale, softcap)
        # one gradient per input as the op was called (defaults left out), a list for the tables
        rest = ([None] * len(x) if isinstance(x, (list, tuple)) else None for x in ctx.needs_input_grad[3:])
        return (dq, dk, dv, *rest)

    op.register_autograd(backward, setup_context=setup_context)
