"""A call's checks and backend choice, and its eager forward: what :func:`spanattn.attention`
runs outside torch.compile and what the torch ops (ops.py) and their backward (grad.py) run
inside. Below all three, so that none of them imports another's caller."""

from __future__ import annotations

import functools
import inspect
import math

import torch

from . import backends, page_check
from .arguments import positive
from .cache import check_block_size, check_paged
from .device_plan import DevicePlan
from .device_planner import refusal
from .plan import Plan

# float64 for checks (torch.autograd.gradcheck; the dense backends compute in it, the kernels refuse it)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
AUTO_ORDER = ("fa4", "triton", "sdpa", "reference")


def check_tensors(q, k, v, plan, block_table=None) -> None:
    """The rules on q, k, v that the plan's own tensors decide (kinds, shapes, dtypes, devices):
    nothing host-side of the plan is read, so torch.compile traces this without guarding on a
    step's lengths."""
    if not isinstance(plan, (Plan, DevicePlan)):
        raise TypeError(
            f"plan must be a spanattn.Plan (from spanattn.plan) or a DevicePlan, got {type(plan).__name__}"
        )
    paged = block_table is not None
    device = plan.lo.device
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if paged and name != "q":
            if t.dim() != 4:
                raise ValueError(
                    f"{name} must be a paged cache [num_blocks, block_size, kv_heads, head_dim] "
                    f"with a block_table, got shape {tuple(t.shape)}"
                )
            check_block_size(name, t)
        elif t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype must be one of float16/bfloat16/float32/float64, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the plan is on {device}; plan on the same device")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, size in (("q heads", q.shape[1]), ("k/v heads", k.shape[-2]), ("head_dim", k.shape[-1])):
        if size == 0:
            raise ValueError(f"{name} must be >= 1, got 0 (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.shape[0] != plan.lo.shape[0]:
        what = "has room for" if plan.capacity is not None else "packs"
        raise ValueError(f"q has {q.shape[0]} tokens but the plan {what} {plan.lo.shape[0]} queries")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of heads, got {k.shape[-2]} and {v.shape[-2]}")
    if q.shape[1] % k.shape[-2]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[-2]}) for GQA")
    if q.shape[2] != k.shape[-1] or v.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k, v must share head_dim, got {q.shape[2]}, {k.shape[-1]}, {v.shape[-1]}")


def _check_packed_keys(k, v, plan) -> None:
    """Packed K/V rows against the plan's keys (host plan) or its max_kv_tokens (device plan)."""
    cap = plan.capacity
    if cap is None:
        if k.shape[0] != plan.total_k or v.shape[0] != plan.total_k:
            raise ValueError(
                f"k and v must have the plan's {plan.total_k} packed keys, got {k.shape[0]} and {v.shape[0]}"
            )
    elif cap.max_kv_tokens is None:
        raise ValueError(
            "packed k, v with a device plan need DevicePlanner(max_kv_tokens=...) (or a paged cache)"
        )
    elif k.shape[0] < cap.max_kv_tokens or v.shape[0] < cap.max_kv_tokens:
        raise ValueError(
            f"k and v must have at least the device plan's max_kv_tokens={cap.max_kv_tokens} rows, "
            f"got {k.shape[0]} and {v.shape[0]}"
        )


def _check_pages(k, v, block_table, plan, how: str) -> None:
    """A paged cache and its table against the plan (every call: the table changes per step),
    its entries as ``how`` (page_check.mode) says. A device plan's entries are the engine's to
    check (its lengths are on the device)."""
    if plan.capacity is not None and torch.is_tensor(block_table) and block_table.dim() == 2:
        need = -(-plan.capacity.max_kv_len // k.shape[1])
        if block_table.shape[1] < need:
            raise ValueError(
                f"block_table has {block_table.shape[1]} blocks per sequence but the device plan's "
                f"max_kv_len={plan.capacity.max_kv_len} needs {need} blocks of {k.shape[1]}"
            )
    check_paged(k, v, block_table, plan, names=("k", "v"))
    page_check.check(block_table, plan, k.shape[0], k.shape[1], how)


@functools.cache
def _reads_pages(mod) -> bool:
    # A backend takes a paged cache only if its forward has a block_table parameter.
    return "block_table" in inspect.signature(mod.forward).parameters


# How a call is differentiated, ``grad`` in a backend's choice (``opts``): None, not at all;
# "eager", an eager call through torch's autograd where its backend's forward is differentiable
# (``NATIVE_AUTOGRAD``), else through the op; "op", through the torch op's autograd (grad.py:
# torch.compile, and the eager calls of the other backends), which needs the backend's own
# ``backward(q, k, v, out, lse, dout, plan, *, scale, softcap, dlse) -> (dq, dk, dv)``.
GRAD_MODES = (None, "eager", "op")


def needs_grad(*tensors) -> bool:
    """Will autograd want gradients of this call's output (grad mode on and an input that
    requires grad)?"""
    return torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors)


def _unavailable(name, mod, q, plan, opts: dict) -> str | None:
    if plan.capacity is not None:
        why = refusal(name)
        if why is not None:
            return why
    if "block_table" in opts and not _reads_pages(mod):
        return "it reads only packed K/V, not a paged cache (block_table)"
    why = mod.unavailable(q, plan, **opts)
    if why is None and opts.get("grad"):
        why = mod.no_backward(q, plan, **opts)
        if why is None and opts["grad"] == "op" and not hasattr(mod, "backward"):
            why = (
                "its gradients come from torch's autograd through its forward, which torch.compile cannot see"
            )
        if why is not None:
            return f"{why} (q, k or v requires grad; under torch.no_grad() it runs)"
    return why


def pick(q, plan, backend: str, opts: dict):
    """The backend module that runs this call (``backend="auto"``: the first in AUTO_ORDER)."""
    if backend != "auto":
        mod = backends.load(backend)
        why = _unavailable(backend, mod, q, plan, opts)
        if why is not None:
            trains = f"; backend={_trainer(q, plan, opts)!r} trains it" if opts.get("grad") else ""
            raise RuntimeError(f"backend={backend!r} cannot run this call: {why}{trains}")
        return mod
    reasons = []
    for name in AUTO_ORDER:
        if name not in backends.BACKENDS:
            continue
        mod = backends.load(name)
        if getattr(mod, "AUTO_NEEDS_CUDA", False) and q.device.type != "cuda":
            continue  # e.g. triton's interpreter: correct but far too slow to pick unasked
        why = _unavailable(name, mod, q, plan, opts)
        if why is None and hasattr(mod, "auto_declines"):  # could run, another suits better
            why = mod.auto_declines(q, plan, **opts)
        if why is None:
            return mod
        reasons.append(f"{name}: {why}")
    raise RuntimeError("no backend can run this call: " + "; ".join(reasons))


def _trainer(q, plan, opts: dict) -> str:
    """A backend that computes this call's gradients (what a refusal names instead)."""
    for name in AUTO_ORDER:
        if name in backends.BACKENDS and _unavailable(name, backends.load(name), q, plan, opts) is None:
            return name
    return "reference"


def auto_choice(
    q: torch.Tensor,
    plan: Plan | DevicePlan,
    softcap: float | None = None,
    return_lse: bool = False,
    grad: str | None = None,
) -> str:
    """The name of the backend that ``spanattn.attention(q, k, v, plan, softcap=...,
    return_lse=...)`` runs with ``backend="auto"`` on this machine (for logs and benchmarks);
    raises as the call would where no backend can run it. grad: ``None`` for a call without
    gradients, ``"eager"`` for an eager call whose q, k or v requires grad (auto then takes a
    backend that trains it; ``"op"``: through the torch op, as under torch.compile).

    >>> import torch, spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=8, spans=[(2, 5)])]), sa.LayerMask(window=4))
    >>> sa.auto_choice(torch.randn(8, 2, 16), p)  # on a CPU
    'sdpa'
    """
    mod = pick(q, plan, "auto", {"softcap": softcap, "return_lse": return_lse, "grad": grad})
    return mod.__name__.rsplit(".", 1)[-1]


def _call_key(q, k, v, plan, block_table, backend, softcap, return_lse, grad=None):
    """What the checks and the backend choice depend on, or None when some argument is not a
    tensor (then the checks say which)."""
    try:
        key = (backend, bool(softcap), return_lse, grad, q.shape, k.shape, v.shape, q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device)  # fmt: skip
        if block_table is not None:
            key += (block_table.shape, block_table.dtype, block_table.device)
    except AttributeError:
        return None
    if plan.capacity is not None and q.is_cuda:  # the dense backends decline while capturing
        key += (torch.cuda.is_current_stream_capturing(),)
    return key


def run(q, k, v, plan, block_table=None, backend="auto", scale=None, softcap=None, return_lse=False,
        check_pages=True, grad=None):  # fmt: skip
    """:func:`attention` outside torch.compile, and the torch ops' implementation: checks,
    backend choice (both kept per plan for calls of the same shapes), forward. Returns
    ``(out, lse or None)``. grad: how the call is differentiated (``GRAD_MODES``)."""
    mod, opts = resolve(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages, grad)
    out, lse = mod.forward(q, k, v, plan, **opts)
    if grad == "eager" and out.grad_fn is None:  # never a model whose attention silently learns nothing
        raise RuntimeError(
            f"spanattn: backend {mod.__name__.rsplit('.', 1)[-1]!r} returned an output without a gradient "
            "although q, k or v requires grad; this is a bug, please report it (backend='reference' trains)"
        )
    return out, lse


def resolve(q, k, v, plan, block_table, backend, scale, softcap, return_lse, check_pages, grad=None):
    """The checks and the backend choice of a call (kept per plan for calls of the same
    shapes): ``(module, its forward's keyword arguments)``."""
    if grad not in GRAD_MODES:
        raise ValueError(f"grad must be one of {GRAD_MODES}, got {grad!r}")
    if not isinstance(plan, (Plan, DevicePlan)):
        check_tensors(q, k, v, plan, block_table)  # raises the plan's TypeError
    scale, softcap = positive("scale", scale), positive("softcap", softcap)
    how = page_check.mode(check_pages)
    opts = {"softcap": softcap, "return_lse": return_lse}
    if block_table is not None:
        opts["block_table"] = block_table
    key = _call_key(q, k, v, plan, block_table, backend, softcap, return_lse, grad)
    mod = plan._facts.get(key) if key is not None else None
    if mod is None:
        check_tensors(q, k, v, plan, block_table)
        if block_table is None:
            _check_packed_keys(k, v, plan)
        else:
            _check_pages(k, v, block_table, plan, how)
        if grad:
            check_trainable(plan, block_table)
        mod = pick(q, plan, backend, {**opts, "grad": grad})
        if key is not None:
            plan._facts[key] = mod
    elif block_table is not None:
        # The key holds what check_paged reads (shapes, dtypes, devices); the entries change.
        page_check.check(block_table, plan, k.shape[0], k.shape[1], how)
    opts["scale"] = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return mod, opts


def check_trainable(plan, block_table) -> None:
    """What no backend trains: a paged cache (serving reads keys in place, and their gradients
    would scatter into cache pages)."""
    if block_table is not None:
        raise ValueError(
            "gradients through a paged KV cache (block_table) are not computed: pass packed k, v "
            "[total_k, Hkv, D] to train, or run the paged call under torch.no_grad()"
        )
