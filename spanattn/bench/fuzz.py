"""Random steps against the fp64 truth, every backend on the same inputs, with the isolation
property checked on a sample: the generator behind the GPU fuzz run (benchmarks/gpu_fuzz.py) and
its CPU-sized twin in the tests.

A step draws 1-8 sequences (decode rows, speculative blocks, chunks with a cached context, fresh
prompts, non-causal canvases), disjoint spans near tile edges that the chunk end never cuts
(in some sequences the spans form span groups, which a chunk end may cut: the group is then
capped at it, ``allow_split_spans``), a window from 1 to past the longest sequence (or none), a
span mode and a non-causal window rule;
then one of a few model shapes (head_dim, query/KV heads, dtype, softcap) so that kernels compile
a bounded number of times, and packed or paged K/V (pages of 16 or 64, shuffled, NaN in every
slot no sequence owns).

>>> import random
>>> case = random_case(random.Random(0), MODELS_CPU, max_tokens=200)
>>> case.batch.total_k <= 200 + 8 * 16
True
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, fields

import torch

import spanattn as sa
from spanattn.cache import to_paged
from spanattn.isolation import POISONS, isolation_violations
from spanattn.oracle import Truth

# (head_dim, query heads, KV heads, dtype, softcap): GQA 1, 2, 4 and 8 among them
MODELS_GPU = [
    (64, 8, 8, torch.float16, None),
    (128, 16, 8, torch.bfloat16, None),
    (128, 8, 1, torch.bfloat16, 30.0),
    (256, 8, 2, torch.bfloat16, None),
    (256, 4, 4, torch.float16, 50.0),
    (512, 8, 2, torch.bfloat16, None),
]
MODELS_CPU = [
    (16, 2, 2, torch.float32, None),
    (32, 4, 1, torch.float16, None),
    (16, 4, 2, torch.float32, 5.0),
]
EDGES = (16, 64, 128)
PACKED_ONLY = ("fa4", "flex")  # backends that read no paged cache


@dataclass
class Case:
    batch: sa.Batch
    layer: sa.LayerMask
    model: tuple
    page_size: int | None

    def describe(self) -> dict:
        d, hq, hkv, dtype, cap = self.model
        layer = self.layer
        return {
            "seqs": [[s.q_len, s.kv_len, [list(x) for x in s.grouped_spans()], s.causal]
                     for s in self.batch.seqs],
            "window": layer.window, "spans": layer.spans, "noncausal_window": layer.noncausal_window,
            "head_dim": d, "hq": hq, "hkv": hkv, "dtype": str(dtype).split(".")[-1], "softcap": cap,
            "page_size": self.page_size,
        }  # fmt: skip


def _spans(rng: random.Random, length: int) -> list[tuple[int, int]]:
    spans, pos = [], rng.randint(0, 40)
    while pos < length and rng.random() < 0.7:
        edge = rng.choice(EDGES)
        start = rng.choice([pos, min(length - 1, -(-pos // edge) * edge), rng.randint(pos, length - 1)])
        end = min(length - 1, start + rng.choice([0, edge - 1, rng.randint(1, max(1, length // 3))]))
        spans.append((start, end))
        pos = end + 1 + rng.randint(0, 60)
    return spans


def _frames(rng: random.Random, length: int) -> list[tuple[int, int, int | None]]:
    """Frames of one length with a few text tokens between them (some past ``length``: later
    chunks of the prompt), each in group 0 mostly, else group 1 or none."""
    frame = rng.choice([1, 7, 16, 33, rng.randint(2, max(2, length // 3))])
    gap = rng.choice([1, 4, 16, rng.randint(1, max(1, length // 4))])
    spans, pos = [], rng.randint(0, min(40, length // 4))
    while pos + frame <= length + 100 and len(spans) < 12:
        spans.append((pos, pos + frame - 1, rng.choice([0, 0, 0, 1, None])))
        pos += frame + gap
    return spans


def _seq(rng: random.Random, kv_len: int, short: bool) -> sa.Seq:
    if short:
        q_len = rng.randint(1, min(16, kv_len))
    else:
        q_len = rng.choice(
            [kv_len, rng.randint(1, kv_len), min(kv_len, rng.choice(EDGES) * rng.randint(1, 8))]
        )
    prompt = kv_len + rng.choice([0, 0, rng.randint(1, 300)])
    spans = []
    for s, e in _spans(rng, prompt):  # a span the chunk end would cut ends at the chunk end instead
        spans.append((s, min(e, kv_len - 1)) if s < kv_len and e >= kv_len and rng.random() < 0.8 else (s, e))
    spans = [(s, e) for s, e in spans if not (s < kv_len <= e)]
    prompt = max([kv_len] + [e + 1 for _, e in spans])
    if rng.random() < 0.3:  # video frames or images in span groups (mostly one group)
        spans = _frames(rng, prompt)
        prompt = max([kv_len] + [e + 1 for _, e, _ in spans])
    return sa.Seq(q_len, kv_len, spans=spans, causal=rng.random() < 0.8, prompt_len=prompt)


def random_case(rng: random.Random, models, max_tokens: int) -> Case:
    """One random step; at most ``max_tokens`` keys (plus one small sequence per slot)."""
    n = rng.randint(1, 8)
    decode = rng.random() < 0.25  # every row short: the split-KV decode kernel's steps
    seqs = []
    for _ in range(n):
        cap = max(1, max_tokens // n)
        kv_len = rng.choice([rng.randint(1, 16), rng.randint(1, cap), rng.randint(cap // 2 + 1, cap)])
        seqs.append(_seq(rng, kv_len, decode or rng.random() < 0.2))
    longest = max(s.kv_len for s in seqs)
    window = rng.choice([None, rng.randint(1, 8), rng.randint(1, longest + 10), rng.choice([64, 128, 1024])])
    layer = sa.LayerMask(window, rng.choice(["on", "clamp", "off"]), rng.choice(["exclusive", "inclusive"]))
    batch = sa.Batch(seqs, allow_split_spans=any(s.cut_span() for s in seqs))
    return Case(batch, layer, rng.choice(models), rng.choice([None, None, 16, 64]))


def inputs(case: Case, device, seed: int):
    """``plan, q, k, v, kc, vc, block_table``: packed K/V and, for a paged case, NaN-filled caches
    holding each sequence's keys in shuffled pages (else kc = vc = block_table = None)."""
    d, hq, hkv, dtype, _ = case.model
    p = sa.plan(case.batch, case.layer, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g, device=device).to(dtype)
               for n, h in ((p.total_q, hq), (p.total_k, hkv), (p.total_k, hkv)))  # fmt: skip
    if case.page_size is None:
        return p, q, k, v, None, None, None
    kc, vc, bt = to_paged(k, v, p, case.page_size, fill=float("nan"), seed=seed)
    return p, q, k, v, kc, vc, bt


@dataclass
class Tally:
    steps: int = 0
    passed: int = 0
    skipped: int = 0
    isolation_checks: int = 0
    isolation_failures: int = 0
    worst_ratio: float = 0.0  # max over steps of err / bound (<= 1 passes)
    failures: list = field(default_factory=list)


def merge(parts: list[dict]) -> dict:
    """One :class:`Tally` per backend from runs over disjoint cases (``fuzz`` with ``first``, e.g.
    in processes of their own): counts added, the worst ratio the worst, failures in order."""
    merged = {}
    for tallies in parts:
        for name, t in tallies.items():
            m = merged.setdefault(name, type(t)())
            for count in (f.name for f in fields(t) if type(f.default) is int):
                setattr(m, count, getattr(m, count) + getattr(t, count))
            m.worst_ratio = max(m.worst_ratio, t.worst_ratio)
            m.failures += t.failures
    return merged


def run_case(case: Case, seed: int, device, backends: list[str], tallies: dict, isolate: bool, victim: int,
             poison: str) -> None:  # fmt: skip
    """Every backend in ``backends`` on one case, held to the truth; with ``isolate``, sequence
    ``victim`` poisoned with ``POISONS[poison]`` too."""
    d, hq, hkv, dtype, cap = case.model
    p, q, k, v, kc, vc, bt = inputs(case, device, seed)
    truth = Truth(q, k, v, p, softcap=cap)
    for name in backends:
        t, mod = tallies[name], sa.backends.load(name)
        paged = bt is not None
        opts = {"backend": name, "softcap": cap, "return_lse": True}
        if paged:
            opts["block_table"] = bt
        why = mod.unavailable(q, p, scale=d**-0.5, softcap=cap, return_lse=True)
        if why is not None:
            t.skipped += 1
            continue
        if paged and name in PACKED_ONLY:  # the same step on its packed K/V
            paged = False
            del opts["block_table"]
        kk, vv = (kc, vc) if paged else (k, v)
        out, lse = sa.attention(q, kk, vv, p, **opts)
        verdict = truth.check(out, lse, rounding_slack=True)
        t.steps += 1
        ratio = max(verdict.err / verdict.bound, verdict.lse_err / verdict.lse_bound)
        t.worst_ratio = max(t.worst_ratio, ratio)
        if verdict.ok:
            t.passed += 1
        else:
            t.failures.append({"seed": seed, "case": case.describe(), "verdict": verdict.as_dict()})
        if isolate and not paged and p.num_seqs > 1:
            run = lambda q_, k_, v_, opts=opts: sa.attention(q_, k_, v_, p, **opts)
            found = isolation_violations(
                run, q, k, v, p, victim=victim, value=POISONS[poison], clean=(out, lse)
            )
            t.isolation_checks += 1
            if found:
                t.isolation_failures += 1
                t.failures.append(
                    {"seed": seed, "case": case.describe(), "isolation": f"{poison} in {victim}: {found}"}
                )


def fuzz(
    steps: int,
    seed: int,
    device,
    backends: list[str],
    models,
    max_tokens: int,
    isolate_every: int = 10,
    log=None,
    max_seconds: float | None = None,
    first: int = 0,
) -> dict:
    """``steps`` random cases (seeded; fewer if ``max_seconds`` runs out first: the tallies say
    how many ran), from the seed's case number ``first`` on: runs with ``first`` 0 and N and N
    steps each run what one run of 2N steps would; returns one :class:`Tally` per backend."""
    rng = random.Random(seed)
    tallies = {name: Tally() for name in backends}
    start = time.perf_counter()
    for i in range(first + steps):
        case = random_case(rng, models, max_tokens)
        victim, poison = rng.randrange(len(case.batch.seqs)), rng.choice(list(POISONS))
        if i < first:  # drawn, not run: the later cases stay the seed's
            continue
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        run_case(case, seed * 100_000 + i, device, backends, tallies, i % isolate_every == 0, victim, poison)
        if log and (i + 1 - first) % max(1, steps // 20) == 0:
            log(f"{i + 1 - first}/{steps} steps: {summary(tallies)}")
    return tallies


def summary(tallies: dict) -> str:
    """One line for a run's progress or end: per backend the steps passed and the worst ratio."""
    return ", ".join(f"{n} {t.passed}/{t.steps} ok, worst {t.worst_ratio:.2f}" for n, t in tallies.items())
