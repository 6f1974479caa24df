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


def test_a_backward_that_does_not_repeat_its_bits_is_held_to_the_bound():
    """sdpa's backward on CUDA: isolation in value (the others' rows within the rule's bound of
    the truth) where bits cannot be compared; a poisoned neighbour's NaN still fails it."""
    import torch

    import spanattn as sa
    from spanattn.isolation import gradient_isolation_violations

    p = sa.plan(sa.Batch([sa.Seq(5), sa.Seq(7)]), sa.LayerMask())
    q, k, v = torch.randn(12, 2, 8), torch.randn(12, 1, 8), torch.randn(12, 1, 8)
    dout = torch.randn(12, 2, 8)

    def grads(q, k, v, dout, noise=1e-6):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sa.attention(*leaves, p, backend="reference")
        return [g + noise * torch.randn_like(g) for g in torch.autograd.grad(out, leaves, dout)]

    truth = grads(q, k, v, dout, noise=0)
    nan = float("nan")
    check = lambda run, **kw: gradient_isolation_violations(run, q, k, v, dout, p, victim=1, value=nan,
                                                            clean=truth, **kw)  # fmt: skip
    assert check(grads) and not check(grads, bounds=(1e-4,) * 3)
    leaky = lambda q, k, v, dout: [g + q.sum() * 0 for g in grads(q, k, v, dout)]  # NaN * 0 reaches all
    assert "sequence 0's dq left the rule's bound" in check(leaky, bounds=(1e-4,) * 3)
