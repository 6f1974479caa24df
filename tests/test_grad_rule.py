"""Gradients of every backend that trains on CPU (reference and sdpa through torch's autograd and
through the op's own backward, triton under TRITON_INTERPRET=1), held to oracle.GradTruth's
rule on random steps: windows, every span mode, span groups, mixed causal flags, chunks, GQA,
softcap, head_dims 16-64 (512 and the padded ones: test_triton_backward.py), an LSE gradient."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import batches, grouped_batches, layers

import spanattn as sa
from spanattn.backends import reference, sdpa
from spanattn.oracle import GradTruth

MODELS = [(16, 2, 2, torch.float32, None), (32, 4, 1, torch.float16, None), (16, 4, 2, torch.float32, 2.5),
          (64, 2, 1, torch.float16, 4.0)]  # fmt: skip
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _grads(backend, plan, q, k, v, dout, dlse, softcap):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = sa.attention(*leaves, plan, backend=backend, softcap=softcap, return_lse=True)
    return torch.autograd.grad((out, lse), leaves, (dout, dlse))


def _check_all(batch, layer, model, seed, monkeypatch):
    d, hq, hkv, dtype, cap = model
    p = sa.plan(batch, layer)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g).to(dtype) for n, h in ((p.total_q, hq), (p.total_k, hkv),
                                                                       (p.total_k, hkv)))  # fmt: skip
    dout, dlse = torch.randn(q.shape, generator=g).to(dtype), torch.randn(q.shape[:2], generator=g)
    truth = GradTruth(q, k, v, p, dout, dlse, softcap=cap)
    backends = ["reference", "triton"] + ([] if cap else ["sdpa"])
    for name in backends:
        verdict = truth.check(*_grads(name, p, q, k, v, dout, dlse, cap), rounding_slack=True)
        assert verdict.ok, f"{name}: {verdict}"
    with monkeypatch.context() as m:  # the same backends through the op's backward (torch.compile's)
        for mod in (reference, sdpa):
            m.setattr(mod, "NATIVE_AUTOGRAD", False)
        for name in set(backends) - {"triton"}:
            verdict = truth.check(*_grads(name, p, q, k, v, dout, dlse, cap), rounding_slack=True)
            assert verdict.ok, f"{name} through the op: {verdict}"


@pytest.fixture(scope="module", autouse=True)
def _triton():
    pytest.importorskip("triton")


@settings(max_examples=100, **SLOW)
@given(batch=batches(max_seqs=3, max_len=48), layer=layers(max_window=50), model=st.sampled_from(MODELS),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_random_steps(batch, layer, model, seed):
    with pytest.MonkeyPatch.context() as mp:
        _check_all(batch, layer, model, seed, mp)


@settings(max_examples=50, **SLOW)
@given(batch=grouped_batches(max_seqs=2, max_len=48), layer=layers(max_window=50),
       model=st.sampled_from(MODELS), seed=st.integers(0, 2**16))  # fmt: skip
def test_random_span_group_steps(batch, layer, model, seed):
    with pytest.MonkeyPatch.context() as mp:
        _check_all(batch, layer, model, seed, mp)
