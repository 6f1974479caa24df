"""reference and sdpa backends against fp64 truth with the tolerance rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, layers
from tolerance import assert_close_to_truth

import spanattn as sa
from spanattn.backends import reference


def _qkv(plan, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(dtype)
    return mk(plan.total_q, hq), mk(plan.total_k, hkv), mk(plan.total_k, hkv)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 1), (6, 2)])
def test_mixed_batch(backend, dtype, hq, hkv):
    batch = sa.Batch(
        [
            sa.Seq(q_len=40, kv_len=100, spans=[(30, 89)]),
            sa.Seq(q_len=1, kv_len=77),
            sa.Seq(q_len=24, kv_len=50, causal=False),
        ]
    )
    p = sa.plan(batch, sa.LayerMask(window=16, spans="clamp"))
    q, k, v = _qkv(p, hq, hkv, 32, dtype)
    out, lse = sa.attention(q, k, v, p, backend=backend, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (p.total_q, hq)
    assert_close_to_truth(out, lse, q, k, v, p)


@settings(max_examples=25, deadline=None)
@given(batch=batches(max_len=120), layer=layers(max_window=130), gqa=st.sampled_from([1, 2]))
def test_random_layouts(batch, layer, gqa):
    p = sa.plan(batch, layer)
    q, k, v = _qkv(p, 2 * gqa, 2, 16, torch.float32)
    for backend in ("reference", "sdpa"):
        out, lse = sa.attention(q, k, v, p, backend=backend, return_lse=True)
        assert_close_to_truth(out, lse, q, k, v, p)


def test_softcap_and_scale_reach_the_scores():
    p = sa.plan(sa.Batch([sa.Seq(q_len=9, spans=[(2, 5)])]), sa.LayerMask(window=3))
    q, k, v = _qkv(p, 2, 2, 8, torch.float64)
    q = q * 10
    out, lse = reference.forward(
        q, k, v, p, scale=0.5, softcap=5.0, return_lse=True, compute_dtype=torch.float64
    )
    s = torch.einsum("qhd,khd->hqk", q, k) * 0.5
    s = (5.0 * torch.tanh(s / 5.0)).masked_fill(~p.to_dense(0), float("-inf"))
    assert lse.dtype == torch.float64 and torch.allclose(lse, torch.logsumexp(s, -1).T)
    assert torch.allclose(out, torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))


def test_auto_on_cpu_is_exact_enough():
    p = sa.plan(sa.Batch([sa.Seq(q_len=17, kv_len=30, spans=[(13, 20)])]), sa.LayerMask(window=5))
    q, k, v = _qkv(p, 4, 2, 16, torch.float32)
    assert_close_to_truth(sa.attention(q, k, v, p), None, q, k, v, p)
