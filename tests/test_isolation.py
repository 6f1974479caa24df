"""Isolation on every backend that runs here: one sequence's NaN, +-Inf or 1e30 in q, k and v
never changes another sequence's output or LSE by a bit, and stale cache slots never matter.

Steps mix a chunk with an image, a decode row, a non-causal canvas and fresh prompts with
lengths that are no multiple of any tile, so key and query tiles would straddle sequences; the
"groups" layer runs the same steps with each sequence's images as two spans of one group. On a
GPU the shapes grow past 128-row tiles and every kernel variant is run: Gluon at head_dim
128/256/512, the split-KV decode kernel, paged in place and by copy, FA4's built-in and sparse
paths, compiled FlexAttention. On CPU the Triton kernels run under the interpreter.
"""

import functools
import importlib.util

import pytest
import torch

import spanattn as sa
from spanattn.backends import load
from spanattn.cache import to_paged
from spanattn.isolation import (
    POISONS,
    compare_others,
    isolation_violations,
    not_finite,
    stale_slot_violations,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SCALE = 1.0  # x 1 / sqrt(D) below; poisons must reach the scores at full size

LAYERS = {
    "clamp": sa.LayerMask(window=16 if not CUDA else 200, spans="clamp"),
    "on": sa.LayerMask(spans="on"),
    "causal": sa.LayerMask(spans="off"),
    "flags": sa.LayerMask(spans="off"),  # the same, the canvas non-causal: fa4 launches once per flag
    "groups": sa.LayerMask(spans="on"),  # the same steps with their images in span groups
}
# (victim, poison): every poison, victims at both ends and in the middle
CASES = [(2, "nan"), (0, "+inf"), (4, "-inf"), (3, "1e30"), (1, "nan")]


def _mixed(big: bool, causal_only: bool = False, groups: bool = False) -> sa.Batch:
    m = 7 if big else 1
    g = (lambda *spans: spans) if groups else (lambda *spans: [(spans[0][0], spans[-1][1])])
    return sa.Batch(
        [
            sa.Seq(q_len=40 * m, kv_len=100 * m + 3, spans=g((30 * m, 59 * m, 0), (70 * m, 89 * m, 0))),
            sa.Seq(q_len=1, kv_len=77 * m),  # decode row
            sa.Seq(q_len=24 * m, kv_len=50 * m + 1, causal=causal_only),  # canvas
            sa.Seq(q_len=33 * m, spans=g((5, 12 * m, 0), (14 * m, 20 * m, 0))),  # fresh prompt
            sa.Seq(q_len=7 * m, kv_len=61 * m, spans=g((50 * m, 54 * m, 0), (57 * m, 60 * m, 0))),
        ]
    )  # each sequence's images: one span, or two spans of one group


def _decode(groups: bool = False) -> sa.Batch:
    g = (lambda *spans: spans) if groups else (lambda *spans: [(spans[0][0], spans[-1][1])])
    return sa.Batch(
        [sa.Seq(q_len=1, kv_len=97), sa.Seq(q_len=4, kv_len=64, spans=g((40, 50, 0), (55, 62, 0))),
         sa.Seq(q_len=1, kv_len=130), sa.Seq(q_len=3, kv_len=50, causal=False), sa.Seq(q_len=2, kv_len=33)]
    )  # fmt: skip


def _variants():
    """(id, backend, head_dim, dtype, step, opts) for every backend and kernel that runs here."""
    big = CUDA
    half = torch.bfloat16 if CUDA else torch.float16
    out = [
        ("reference", "reference", 32, torch.float32, "mixed", {}),
        ("sdpa", "sdpa", 32, torch.float32, "mixed", {}),
        ("flex", "flex", 32, torch.float16 if CUDA else torch.float32, "mixed", {}),
    ]
    if importlib.util.find_spec("triton"):
        out += [
            ("triton", "triton", 32 if not big else 64, half, "mixed", {}),
            ("triton-decode", "triton", 32, half, "decode", {}),
        ]
        if CUDA:
            out += [(f"triton-d{d}", "triton", d, torch.bfloat16, "mixed", {}) for d in (128, 256, 512)]
    if CUDA and importlib.util.find_spec("flash_attn"):
        out += [(f"fa4-d{d}", "fa4", d, torch.bfloat16, "mixed", {}) for d in (128, 256)]
    return out


VARIANTS = _variants()


@functools.cache
def _inputs(step: str, layer: str, d: int, dtype):
    groups = layer == "groups"
    batch = (
        _decode(groups) if step == "decode" else _mixed(CUDA, causal_only=layer == "causal", groups=groups)
    )
    p = sa.plan(batch, LAYERS[layer], device=DEV)
    assert (p.groups is not None) == groups
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in ((p.total_q, 4), (p.total_k, 2), (p.total_k, 2)))
    return p, *(t.to(dtype).to(DEV) for t in (q, k, v))


def _runner(backend, p, q, opts):
    d = q.shape[-1]
    if (why := load(backend).unavailable(q, p)) is not None:
        pytest.skip(why)
    opts = dict(backend=backend, scale=SCALE * d**-0.5, return_lse=True, **opts)
    return lambda q, k, v: sa.attention(q, k, v, p, **opts)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("name, backend, d, dtype, step, opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_poisoned_neighbour_changes_nothing(name, backend, d, dtype, step, opts, layer):
    p, q, k, v = _inputs(step, layer, d, dtype)
    run = _runner(backend, p, q, opts)
    clean = run(q, k, v)
    for victim, poison in CASES:
        found = isolation_violations(run, q, k, v, p, victim=victim, value=POISONS[poison], clean=clean)
        assert not found, f"{poison} in sequence {victim}: {found}"


def _paged(step: str, layer: str, d: int, dtype, page: int):
    p, q, k, v = _inputs(step, layer, d, dtype)
    return p, q, *to_paged(k, v, p, page, seed=1)


PAGED = [
    ("reference", "reference", 32, torch.float32, "mixed", 16),
    ("triton", "triton", 32, torch.bfloat16 if CUDA else torch.float16, "mixed", 16),
    ("triton-decode", "triton", 32, torch.bfloat16 if CUDA else torch.float16, "decode", 16),
]
if CUDA:
    PAGED += [
        (f"triton-d{d}-page{pg}", "triton", d, torch.bfloat16, "mixed", pg)
        for d in (128, 256)
        for pg in (16, 64)
    ]


@pytest.mark.parametrize("name, backend, d, dtype, step, page", PAGED, ids=[v[0] for v in PAGED])
def test_stale_cache_slots_change_nothing(name, backend, d, dtype, step, page):
    p, q, kc, vc, bt = _paged(step, "clamp", d, dtype, page)
    run = _runner(backend, p, q, {"block_table": bt})
    run_paged = lambda q, kc, vc: run(q, kc, vc)
    for poison in ("nan", "+inf"):
        found = stale_slot_violations(run_paged, q, kc, vc, bt, p, POISONS[poison])
        assert not found, f"{poison} in stale slots: {found}"


@pytest.mark.parametrize("name, backend, d, dtype, step, page", PAGED, ids=[v[0] for v in PAGED])
def test_poisoned_neighbour_in_a_paged_cache_changes_nothing(name, backend, d, dtype, step, page):
    p, q, kc, vc, bt = _paged(step, "on", d, dtype, page)
    run = _runner(backend, p, q, {"block_table": bt})
    clean = run(q, kc, vc)
    victim, cu = 2, p.cu_seqlens_q.tolist()
    kd, vd = kc.clone(), vc.clone()
    for j in range(-(-p.batch.seqs[victim].kv_len // page)):
        kd[bt[victim, j]], vd[bt[victim, j]] = float("nan"), float("inf")
    qd = q.clone()
    qd[cu[victim] : cu[victim + 1]] = float("nan")
    dirty = run(qd, kd, vd)
    found = not_finite(p, clean) + compare_others(p, clean, dirty, victim)
    assert not found, found
