"""Random steps with gradients against the fp64 truth: the random cases of fuzz.py (packed K/V:
nothing trains through a paged cache), each backend that trains a case run forward and backward
with a random output gradient and LSE gradient, dq, dk, dv held to the rule of
``oracle.GradTruth``; on a sample, the same backward again (bit for bit: no unordered atomics)
and one sequence's q, k, v and output gradient poisoned (``isolation.gradient_isolation_violations``:
no other sequence's gradients may change a bit). What benchmarks/gpu_grad_fuzz.py runs; its
CPU-sized twin runs in the tests.

>>> import random
>>> case = random_case(random.Random(0), MODELS_CPU, max_tokens=100)
>>> tallies = {"reference": GradTally()}
>>> run_grad_case(case, 0, "cpu", ["reference"], tallies, True, 0, "nan")
>>> t = tallies["reference"]; (t.steps, t.passed, t.isolation_failures, t.repeat_failures)
(1, 1, 0, 0)
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import torch

import spanattn as sa
from spanattn.bench.fuzz import MODELS_CPU, MODELS_GPU, Tally, inputs, random_case
from spanattn.isolation import POISONS, bitwise_equal, gradient_isolation_violations
from spanattn.oracle import GradTruth

__all__ = ["MODELS_CPU", "MODELS_GPU", "GradTally", "grad_fuzz", "run_grad_case"]


@dataclass
class GradTally(Tally):
    repeat_checks: int = 0  # the same backward twice: equal bits
    repeat_failures: int = 0


def _grads_of(name: str, plan, softcap, dlse):
    """``run(q, k, v, dout) -> (dq, dk, dv)`` through ``spanattn.attention`` on backend ``name``."""

    def run(q, k, v, dout):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = sa.attention(*leaves, plan, backend=name, softcap=softcap, return_lse=True)
        return torch.autograd.grad((out, lse), leaves, (dout, dlse))

    return run


def run_grad_case(case, seed: int, device, backends: list[str], tallies: dict, isolate: bool, victim: int,
                  poison: str) -> None:  # fmt: skip
    """Every backend in ``backends`` that trains the case, its gradients held to the truth; with
    ``isolate``, the repeat and the poisoned sequence ``victim`` too."""
    d, hq, hkv, dtype, cap = case.model
    case = replace(case, page_size=None)  # its packed K/V: nothing trains through a paged cache
    p, q, k, v, *_ = inputs(case, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=g, device=device).to(dtype)
    dlse = torch.randn(q.shape[:2], generator=g, device=device)
    truth = GradTruth(q, k, v, p, dout, dlse, softcap=cap)
    for name in backends:
        t, mod = tallies[name], sa.backends.load(name)
        why = mod.unavailable(q, p, scale=d**-0.5, softcap=cap, return_lse=True) or mod.no_backward(q, p)
        if why is not None:
            t.skipped += 1
            continue
        run = _grads_of(name, p, cap, dlse)
        try:
            grads = run(q, k, v, dout)
        except RuntimeError as e:  # a backend that raises on a step it accepted fails the step
            t.steps += 1
            error = f"{type(e).__name__}: {e}"[:2000]
            t.failures.append({"seed": seed, "case": case.describe(), "error": error})
            continue
        verdict = truth.check(*grads, rounding_slack=True)
        t.steps += 1
        t.worst_ratio = max(t.worst_ratio, *(x.err / x.bound for x in (verdict.dq, verdict.dk, verdict.dv)))
        if verdict.ok:
            t.passed += 1
        else:
            t.failures.append({"seed": seed, "case": case.describe(), "verdict": verdict.as_dict()})
        if not isolate:
            continue
        repeatable = not q.is_cuda or getattr(mod, "REPEATABLE_BACKWARD_ON_CUDA", True)
        if repeatable:
            t.repeat_checks += 1
            if not all(bitwise_equal(a, b) for a, b in zip(grads, run(q, k, v, dout))):
                t.repeat_failures += 1
                t.failures.append({"seed": seed, "case": case.describe(), "repeat": "gradients changed"})
        if p.num_seqs > 1:
            # a backward that does not repeat its bits is held to the rule on the others' rows instead
            clean, bounds = (grads, None) if repeatable else (truth.grads, truth.bounds)
            found = gradient_isolation_violations(run, q, k, v, dout, p, victim=victim, value=POISONS[poison],
                                                  clean=clean, bounds=bounds)  # fmt: skip
            t.isolation_checks += 1
            if found:
                t.isolation_failures += 1
                t.failures.append(
                    {"seed": seed, "case": case.describe(), "isolation": f"{poison} in {victim}: {found}"}
                )


def grad_fuzz(steps: int, seed: int, device, backends: list[str], models, max_tokens: int,
              isolate_every: int = 5, log=None, max_seconds: float | None = None) -> dict:  # fmt: skip
    """``steps`` random cases (seeded; fewer if ``max_seconds`` runs out: the tallies say how many
    ran); one :class:`GradTally` per backend."""
    rng = random.Random(seed)
    tallies = {name: GradTally() for name in backends}
    start = time.perf_counter()
    for i in range(steps):
        case = random_case(rng, models, max_tokens)
        victim, poison = rng.randrange(len(case.batch.seqs)), rng.choice(list(POISONS))
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        run_grad_case(
            case, seed * 100_000 + i, device, backends, tallies, i % isolate_every == 0, victim, poison
        )
        if log and (i + 1) % max(1, steps // 20) == 0:
            log(f"{i + 1}/{steps} steps: " + ", ".join(
                f"{n} {t.passed}/{t.steps} ok, worst {t.worst_ratio:.2f}, isolation {t.isolation_failures}"
                f"/{t.isolation_checks} failed, repeat {t.repeat_failures}/{t.repeat_checks}"
                for n, t in tallies.items()))  # fmt: skip
    return tallies
