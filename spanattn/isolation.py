"""Isolation, the serving promise of docs/design.md section 3, as a check: the output of a sequence
depends only on its own q, k, v and its own cache slots. One sequence's NaN, +-Inf or huge values
(or stale cache slots that no sequence owns) must not change any other sequence's output or LSE
by a single bit, and the clean step must be finite.

Written once for the tests and the GPU fuzz script:

>>> import torch, spanattn as sa
>>> p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5), sa.Seq(q_len=2, kv_len=4)]), sa.LayerMask())
>>> q = torch.randn(5, 2, 16); k = v = torch.randn(9, 1, 16)
>>> run = lambda q, k, v: sa.attention(q, k, v, p, return_lse=True)
>>> isolation_violations(run, q, k, v, p, victim=1, value=float("nan"))
[]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

POISONS = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "1e30": 1e30}


def _rows(cu: torch.Tensor, i: int) -> slice:
    return slice(int(cu[i]), int(cu[i + 1]))


def poisoned(x: torch.Tensor, rows: slice, value: float) -> torch.Tensor:
    """A copy of ``x`` with ``rows`` (first dimension) set to ``value`` (cast to x's dtype: 1e30
    becomes inf in fp16)."""
    x = x.clone()
    x[rows] = value
    return x


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equal to the same NaN, -0 unequal to +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def compare_others(plan, clean, dirty, victim: int | None) -> list[str]:
    """What differs between two ``(out, lse)`` results outside sequence ``victim`` (None: all)."""
    cu = plan.cu_seqlens_q.cpu()
    found = []
    for name, a, b in zip(("out", "lse"), clean, dirty):
        if a is None:
            continue
        for i in range(plan.num_seqs):
            rows = _rows(cu, i)
            if i != victim and not bitwise_equal(a[rows], b[rows]):
                found.append(f"sequence {i}'s {name} changed")
    return found


def not_finite(plan, result) -> list[str]:
    """Sequences whose ``out`` or ``lse`` hold a NaN or Inf."""
    cu = plan.cu_seqlens_q.cpu()
    return [
        f"sequence {i}'s {name} is not finite"
        for name, t in zip(("out", "lse"), result)
        if t is not None
        for i in range(plan.num_seqs)
        if not bool(torch.isfinite(t[_rows(cu, i)]).all())
    ]


def isolation_violations(
    run: Callable, q, k, v, plan, *, victim: int, value: float, parts: str = "qkv", clean=None
) -> list[str]:
    """Run ``run(q, k, v) -> (out, lse)`` on packed inputs as given and with sequence ``victim``'s
    rows of ``parts`` (any of "q", "k", "v") set to ``value``; list every way the promise broke.
    ``clean``: the clean result if already computed."""
    clean = run(q, k, v) if clean is None else clean
    qr, kr = _rows(plan.cu_seqlens_q.cpu(), victim), _rows(plan.cu_seqlens_k.cpu(), victim)
    dirty = run(
        poisoned(q, qr, value) if "q" in parts else q,
        poisoned(k, kr, value) if "k" in parts else k,
        poisoned(v, kr, value) if "v" in parts else v,
    )
    return not_finite(plan, clean) + compare_others(plan, clean, dirty, victim)


def unowned_slots(k_cache, block_table, plan) -> torch.Tensor:
    """Bool ``[num_blocks * block_size]``: cache slots that hold none of the plan's keys (other
    blocks, the tail of each sequence's last page)."""
    from .cache import key_slots

    owned = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool, device=k_cache.device)
    owned[key_slots(plan, block_table, k_cache.shape[1])] = True
    return ~owned


def stale_slot_violations(run: Callable, q, k_cache, v_cache, block_table, plan, value: float) -> list[str]:
    """Paged: ``run(q, k_cache, v_cache) -> (out, lse)`` with every unowned slot zero and with
    every unowned slot ``value``; list what changed or is not finite."""
    stale = unowned_slots(k_cache, block_table, plan)
    caches = []
    for fill in (0.0, value):
        kc, vc = k_cache.clone(), v_cache.clone()
        for c in (kc, vc):
            c.view(-1, *c.shape[2:])[stale] = fill
        caches.append((kc, vc))
    clean = run(q, *caches[0])
    return not_finite(plan, clean) + compare_others(plan, clean, run(q, *caches[1]), None)


def gradient_isolation_violations(
    run: Callable, q, k, v, dout, plan, *, victim: int, value: float, parts: str = "qkvo", clean=None,
    bounds=None,
) -> list[str]:  # fmt: skip
    """The promise in the backward: ``run(q, k, v, dout) -> (dq, dk, dv)`` on packed inputs as
    given and with sequence ``victim``'s rows of ``parts`` (any of "q", "k", "v" and "o" for the
    output's gradient) set to ``value``; every other sequence's dq (its query rows) and dk, dv
    (its key rows) must keep their bits, and the clean gradients be finite. With ``bounds`` (a
    backward that does not repeat its bits: ``clean`` is then the truth), the others' rows must
    stay within them of ``clean`` instead."""
    clean = run(q, k, v, dout) if clean is None else clean
    cu_q, cu_k = plan.cu_seqlens_q.cpu(), plan.cu_seqlens_k.cpu()
    qr, kr = _rows(cu_q, victim), _rows(cu_k, victim)
    dirty = run(
        poisoned(q, qr, value) if "q" in parts else q,
        poisoned(k, kr, value) if "k" in parts else k,
        poisoned(v, kr, value) if "v" in parts else v,
        poisoned(dout, qr, value) if "o" in parts else dout,
    )
    found = []
    spans = (cu_q, cu_k, cu_k)
    for name, a, b, cu, bound in zip(("dq", "dk", "dv"), clean, dirty, spans, bounds or (None,) * 3):
        for i in range(plan.num_seqs):
            rows = _rows(cu, i)
            if not bool(torch.isfinite(a[rows]).all()):
                found.append(f"sequence {i}'s {name} is not finite")
            if i == victim:
                continue
            if bound is None and not bitwise_equal(a[rows], b[rows]):
                found.append(f"sequence {i}'s {name} changed")
            if bound is not None and not (b[rows].double() - a[rows].double()).abs().max() <= bound:
                found.append(f"sequence {i}'s {name} left the rule's bound")
    return found
