"""Backends: each lowers a Plan's intervals its own way. A registry maps names to modules
that are imported only when chosen, so optional dependencies stay optional."""

from __future__ import annotations

import importlib

BACKENDS = {
    "reference": "spanattn.backends.reference",
    "sdpa": "spanattn.backends.sdpa",
    "flex": "spanattn.backends.flex",
    "triton": "spanattn.backends.triton",
    "fa4": "spanattn.backends.fa4",
}


def load(name: str):
    """The module of backend ``name``; it exposes ``unavailable(q, plan, **opts) -> str | None``
    (why it cannot run this call), ``no_backward(q, plan, **opts) -> str | None`` (why it cannot
    give this call's gradients: asked only when q, k or v requires grad) and
    ``forward(q, k, v, plan, **opts) -> (out, lse)``; one with
    per-plan tables also has ``prepare(plan, head_dim)`` to build them ahead of the first call,
    and one that ``backend="auto"`` should pass over for some steps it can run has
    ``auto_declines(q, plan, **opts) -> str | None``."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name])
