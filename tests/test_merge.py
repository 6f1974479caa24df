"""merge_attention_states: merging attention over two disjoint key sets equals attention over
their union; empty parts (LSE = -inf) never make NaN."""

import pytest
import torch

import spanattn as sa

INF = float("inf")


def _attend_all(q, k, v, scale):
    """Every query sees every key: a non-causal sequence with no window (one sequence per query
    when there are fewer keys than queries, since a plan needs q_len <= kv_len)."""
    if q.shape[0] > k.shape[0]:
        outs = [_attend_all(q[i : i + 1], k, v, scale) for i in range(q.shape[0])]
        return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])
    p = sa.plan(sa.Batch([sa.Seq(q_len=q.shape[0], kv_len=k.shape[0], causal=False)]), sa.LayerMask())
    return sa.attention(q, k, v, p, backend="reference", scale=scale, return_lse=True)


@pytest.mark.parametrize("split", [1, 20, 49])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_equals_union(split, dtype):
    g = torch.Generator().manual_seed(split)
    q, k, v = (torch.randn(n, h, 16, generator=g).to(dtype) for n, h in ((5, 4), (50, 2), (50, 2)))
    full, full_lse = _attend_all(q, k, v, 0.3)
    oa, la = _attend_all(q, k[:split], v[:split], 0.3)
    ob, lb = _attend_all(q, k[split:], v[split:], 0.3)
    out, lse = sa.merge_attention_states(oa, la, ob, lb)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: the parts were rounded to fp16
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, full, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, full_lse.float(), atol=1e-5, rtol=1e-5)


def test_empty_parts():
    o = torch.randn(3, 2, 8)
    lse = torch.randn(3, 2)
    empty = torch.full((3, 2), -INF)
    out, l2 = sa.merge_attention_states(o, lse, torch.full_like(o, 7.0), empty)
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(l2, lse)
    out, l2 = sa.merge_attention_states(torch.full_like(o, 7.0), empty, o, lse)
    torch.testing.assert_close(out, o)
    out, l2 = sa.merge_attention_states(o, empty, o, empty)
    assert not out.isnan().any() and (out == 0).all() and torch.isneginf(l2).all()


def test_half_inputs_and_large_lse():
    o = torch.randn(4, 2, 8).half()
    lse = torch.tensor([[1e4, -1e4]] * 4)
    out, l2 = sa.merge_attention_states(o, lse, o, lse)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(l2, lse + torch.log(torch.tensor(2.0)))


def test_errors_name_the_argument():
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    with pytest.raises(ValueError, match="out_b"):
        sa.merge_attention_states(o, lse, o[:2], lse)
    with pytest.raises(ValueError, match="lse_b"):
        sa.merge_attention_states(o, lse, o, lse[:, :1])
    with pytest.raises(TypeError, match="lse_a"):
        sa.merge_attention_states(o, lse.long(), o, lse)
    with pytest.raises(TypeError, match="out_b"):
        sa.merge_attention_states(o, lse, o.half(), lse)
    with pytest.raises(ValueError, match="out_a"):
        sa.merge_attention_states(o[0], lse, o, lse)


def test_infinite_parts():
    """LSE +inf (an overflowed score) takes the whole weight, two such parts half each, LSE +inf;
    before, exp(inf - inf) made the row NaN. Both -inf: a row that saw no key, zero and -inf."""
    oa, ob = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    la = torch.tensor([[INF], [INF], [0.3], [-INF]])
    lb = torch.tensor([[INF], [0.5], [INF], [-INF]])
    out, lse = sa.merge_attention_states(oa, la, ob, lb)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out[0], (oa[0] + ob[0]) / 2)
    assert torch.equal(out[1], oa[1]) and torch.equal(out[2], ob[2]) and (out[3] == 0).all()
    assert lse[:3].isposinf().all() and lse[3].isneginf().all()


def test_gradients_through_merge_are_autograd_s_and_finite_at_infinite_lses():
    """Cascade and context-parallel training differentiate the merge: gradcheck in float64 on
    finite states, and rows with an empty or an overflowed part give finite gradients (no
    torch.where branch left out holds an infinity)."""
    g = torch.Generator().manual_seed(0)
    f64 = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    states = (f64(4, 2, 3), f64(4, 2), f64(4, 2, 3), f64(4, 2))
    assert torch.autograd.gradcheck(sa.merge_attention_states, states)
    inf = float("inf")
    la = torch.tensor([[0.5, -inf], [-inf, inf], [inf, 1.0], [2.0, 0.3]], requires_grad=True)
    lb = torch.tensor([[-inf, -inf], [0.2, inf], [3.0, -inf], [-1.0, 0.7]], requires_grad=True)
    oa, ob = (torch.randn(4, 2, 3, generator=g, requires_grad=True) for _ in range(2))
    out, lse = sa.merge_attention_states(oa, la, ob, lb)
    (out.sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (oa, ob, la, lb))
    assert torch.equal(out[0, 1], torch.zeros(3)) and lse[0, 1] == -inf  # both parts empty
