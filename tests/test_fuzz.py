"""The GPU fuzz run's generator at CPU size: random steps on every backend that runs here, each
held to the fp64 truth, isolation checked on every other step."""

import random

import torch

import spanattn as sa
from spanattn.bench import fuzz as fuzz_module
from spanattn.bench.fuzz import MODELS_CPU, fuzz, merge, random_case


def test_random_steps_hold_the_rule_and_isolation():
    backends = ["reference", "sdpa", "flex", "triton"]
    tallies = fuzz(
        16, seed=3, device="cpu", backends=backends, models=MODELS_CPU, max_tokens=160, isolate_every=2
    )
    for name, t in tallies.items():
        assert not t.failures, f"{name}: {t.failures[:2]}"
        assert t.steps + t.skipped == 16 and t.steps > 0 and t.isolation_checks > 0, name


def test_the_generator_covers_what_it_promises():
    rng = random.Random(0)
    cases = [random_case(rng, MODELS_CPU, max_tokens=400) for _ in range(300)]
    seqs = [s for c in cases for s in c.batch.seqs]
    assert any(not s.causal for s in seqs) and any(s.q_len == 1 for s in seqs) and any(s.spans for s in seqs)
    assert any(s.ctx > 0 and s.q_len > 16 for s in seqs)  # chunks after a cached context
    grouped = [sa.plan(c.batch, c.layer) for c in cases if any(s.groups for s in c.batch.seqs)]
    assert sum(p.groups is not None for p in grouped) > 10  # span groups with two spans or more
    assert {c.layer.spans for c in cases} == {"on", "clamp", "off"}
    assert {c.page_size for c in cases} == {None, 16, 64}
    assert any(c.layer.window == 1 for c in cases)  # windows down to a single key
    assert any(max(s.q_len for s in c.batch.seqs) <= 16 for c in cases)  # decode-shaped steps occur
    assert {c.model[3] for c in cases} == {torch.float32, torch.float16}


def test_a_run_split_in_two_runs_the_same_cases(monkeypatch):
    """``first``: 5 cases from case 0, then 7 from case 5, run what 12 from case 0 run (the GPU run
    can be spread over calls), each case with its input seed, isolation sample and poison."""
    ran = []
    monkeypatch.setattr(
        fuzz_module, "run_case", lambda case, seed, *rest: ran.append((case.describe(), seed, *rest[3:]))
    )
    run_from = lambda first, steps: fuzz(steps, 7, "cpu", [], MODELS_CPU, 300, isolate_every=3, first=first)
    run_from(0, 12)
    one, ran[:] = list(ran), []
    run_from(0, 5), run_from(5, 7)
    assert ran == one and len({r[1] for r in one}) == 12


def test_runs_over_disjoint_cases_merge_into_the_whole_run():
    """What ``gpu_fuzz.py --workers`` adds up: two runs from cases 0 and 4 give the tallies of one
    run of all (counts, worst ratio, failures)."""
    backends = ["reference", "sdpa"]
    run_from = lambda first, steps: fuzz(
        steps, 5, "cpu", backends, MODELS_CPU, 120, isolate_every=2, first=first
    )
    assert merge([run_from(0, 4), run_from(4, 5)]) == run_from(0, 9)
