"""The GPU gradient fuzz run's generator at CPU size (spanattn.bench.grad_fuzz): random steps
with gradients on every backend that trains here, dq, dk, dv held to the fp64 truth, the
repeat and the isolation of the backward checked on every other step."""

from spanattn.bench.grad_fuzz import MODELS_CPU, grad_fuzz


def test_random_steps_with_gradients_hold_the_rule_repeat_and_isolation():
    backends = ["reference", "sdpa", "flex", "triton"]
    tallies = grad_fuzz(12, seed=4, device="cpu", backends=backends, models=MODELS_CPU, max_tokens=120,
                        isolate_every=2)  # fmt: skip
    for name, t in tallies.items():
        assert not t.failures, f"{name}: {t.failures[:2]}"
        assert t.steps + t.skipped == 12, name
    for name in ("reference", "sdpa"):
        t = tallies[name]
        assert t.steps > 0 and t.repeat_checks > 0 and t.isolation_checks > 0, name
    assert tallies["flex"].steps == 0  # no CPU backward in torch's FlexAttention: refused, counted skipped
