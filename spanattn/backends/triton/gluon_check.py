"""A first-use self-check of the Gluon kernels on a triton they were not checked on.

Gluon is experimental and changes between triton releases; a user who installs today's torch
gets a newer triton than the one the kernels were checked on (gluon_parts.CHECKED_TRITON).
Rather than pin the fast path to that version, the first step that would run a Gluon kernel
module on such a triton first runs it on a small step of every variant it serves (each head_dim,
packed and paged K/V, a window with spans and a global layer, with and without span groups)
against the fp64 truth (spanattn.oracle); the backward (``gluon_backward``) its dq, dk, dv by
the gradient rule, on steps without span groups, one with a sequence shorter than a dQ key
tile. If every variant compiles and passes, the module runs from then on; if one fails, one
warning says why and the plain Triton kernel runs instead. Once per module, device and process:
about a second of compiling per variant, on the first step only.

The check runs the backend's own routing (``forward``, ``uses_gluon``; ``backward``,
``gluon_backward_runs``), which asks this module whether a Gluon kernel may run: the backend
package passes itself in (``backend``) rather than being imported from here.
"""

from __future__ import annotations

import functools
import warnings

import torch

# head_dims each Gluon module serves (GLUON_KERNELS in __init__.py; the backward's, its kernels')
HEAD_DIMS = {"kernel_gluon": (128, 256), "kernel_gluon_split": (512,), "gluon_backward": (128, 256, 512)}
BACKWARD = "gluon_backward"
_RUNNING: set[str] = set()  # modules under check: their own check must reach them


def running(name: str) -> bool:
    return name in _RUNNING


def _variants(name: str):
    """(head_dim, batch, layer, page size or None) of each step the check of ``name`` runs."""
    import spanattn as sa

    seqs = [sa.Seq(q_len=200, kv_len=333, spans=[(40, 250)]), sa.Seq(q_len=130, kv_len=130, causal=False),
            sa.Seq(q_len=70, kv_len=190, spans=[(100, 160)])]  # fmt: skip
    frames = [(20, 99, 0), (130, 209, 0), (240, 330, 0)]  # a span group: frames with text between
    grouped = [sa.Seq(q_len=300, kv_len=420, spans=frames), seqs[1]]
    short = [*seqs, sa.Seq(q_len=9, kv_len=20)]  # shorter than a dQ key tile: dK/dV alone on Gluon
    for d in HEAD_DIMS[name]:
        for batch in (seqs, short) if name == BACKWARD else (seqs, grouped):
            for layer in (sa.LayerMask(window=64, spans="clamp"), sa.LayerMask(spans="on")):
                for page in (None,) if name == BACKWARD else (None, 64):
                    yield d, sa.Batch(batch), layer, page


def _one_backward(backend, d, batch, layer, page, device) -> str | None:
    """Why this backward variant fails, or None: the backend's forward and backward (which routes
    to the Gluon kernels while their check runs) against the fp64 gradients."""
    import spanattn as sa
    from spanattn.oracle import GradTruth

    p = sa.plan(batch, layer, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.bfloat16, generator=g)
               for n, h in ((p.total_q, 4), (p.total_k, 2), (p.total_k, 2)))  # fmt: skip
    dout = torch.randn(q.shape, device=device, dtype=q.dtype, generator=g)
    if not backend.gluon_backward_runs(p, d, q.dtype):
        return "the check step would not reach the Gluon backward"
    out, lse = backend.forward(q, k, v, p, scale=d**-0.5, return_lse=True)
    grads = backend.backward(q, k, v, out, lse, dout, p, scale=d**-0.5)
    verdict = GradTruth(q, k, v, p, dout, None, scale=d**-0.5).check(*grads, rounding_slack=True)
    return None if verdict.ok else f"backward, head_dim {d}, {layer}: {verdict}"


def _one(backend, d, batch, layer, page, device) -> str | None:
    """Why this variant fails, or None, run through ``backend`` (the triton backend package)."""
    import spanattn as sa
    from spanattn.oracle import Truth

    from .configs import pick_gluon

    p = sa.plan(batch, layer, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device=device, dtype=torch.bfloat16, generator=g)
               for n, h in ((p.total_q, 4), (p.total_k, 2), (p.total_k, 2)))  # fmt: skip
    opts = dict(scale=d**-0.5, return_lse=True, out=torch.full_like(q, float("nan")))
    if page is None:
        if not backend.uses_gluon(q, k, v, p, pick_gluon(d, q.dtype)):
            return "the check step would not reach the Gluon kernel"
        out, lse = backend.forward(q, k, v, p, **opts)
    else:
        from spanattn.cache import to_paged

        kc, vc, table = to_paged(k, v, p, page, fill=float("nan"))
        out, lse = backend.forward(q, kc, vc, p, block_table=table, **opts)
    verdict = Truth(q, k, v, p, scale=d**-0.5).check(out, lse, rounding_slack=True)
    return None if verdict.ok else f"head_dim {d}, {layer}, page {page}: {verdict}"


def self_check(name: str, device, backend=None, run=None) -> bool:
    """Run Gluon module ``name`` on its check variants through ``backend`` (``run(d, batch,
    layer, page, device)`` instead, for tests); warn once and return False on the first failure
    (a wrong result or any exception, e.g. a Gluon API the installed triton lacks)."""
    import triton

    run = run or functools.partial(_one_backward if name == BACKWARD else _one, backend)
    _RUNNING.add(name)
    try:
        for variant in _variants(name):
            why = run(*variant, device)
            if why is not None:
                break
    except Exception as e:  # compile errors of a changed Gluon API land here
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        _RUNNING.discard(name)
    if why is not None:
        warnings.warn(
            f"spanattn: the Gluon kernel {name} failed its self-check on triton {triton.__version__} "
            f"({why}); the plain Triton kernel runs instead (SPANATTN_TRITON_GLUON=1 forces it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


@functools.cache
def passes(name: str, device_index: int, backend) -> bool:
    """:func:`self_check` once per module and device."""
    return self_check(name, torch.device("cuda", device_index), backend)
