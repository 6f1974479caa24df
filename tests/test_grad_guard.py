"""No output without its gradient: a call whose q, k or v requires grad either returns an output
autograd can differentiate or raises, naming the backend and one that trains. A model that
trains through a silently gradient-free attention learns nothing there and nobody notices."""

import pytest
import torch

import spanattn as sa
from spanattn import backends
from spanattn.backends import sdpa

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PLAN = sa.plan(sa.Batch([sa.Seq(q_len=7, kv_len=9, spans=[(3, 6)]), sa.Seq(5)]), sa.LayerMask(window=4),
               device=DEV)  # fmt: skip


def _inputs(requires_grad=True, dtype=torch.float32):
    shapes = ((PLAN.total_q, 4), (PLAN.total_k, 2), (PLAN.total_k, 2))
    return [torch.randn(n, h, 16, device=DEV, dtype=dtype, requires_grad=requires_grad) for n, h in shapes]


@pytest.mark.parametrize("backend", ["auto", *backends.BACKENDS])
def test_an_output_has_a_gradient_or_the_call_raises(backend):
    q, k, v = _inputs()
    try:
        out = sa.attention(q, k, v, PLAN, backend=backend)
    except RuntimeError as e:
        assert backend != "auto"
        message = str(e)
        if "requires grad" not in message:  # cannot run here at all (a missing optional package)
            with torch.no_grad(), pytest.raises(RuntimeError):
                sa.attention(q, k, v, PLAN, backend=backend)
            return
        assert f"backend={backend!r}" in message and "trains it" in message
        with torch.no_grad():  # the same call runs without gradients
            assert sa.attention(q, k, v, PLAN, backend=backend).shape == q.shape
        return
    assert out.grad_fn is not None
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_a_refusal_names_a_backend_that_trains_the_call():
    q, k, v = _inputs()
    name = sa.auto_choice(q, PLAN, grad="eager")
    assert backends.load(name).no_backward(q, PLAN) is None
    out = sa.attention(q, k, v, PLAN, backend=name)
    assert out.grad_fn is not None


def test_inputs_without_grad_or_grad_mode_off_run_as_before():
    q, k, v = _inputs(requires_grad=False)
    assert sa.attention(q, k, v, PLAN).grad_fn is None
    q, k, v = _inputs()
    with torch.no_grad():
        assert sa.attention(q, k, v, PLAN).grad_fn is None
    with torch.inference_mode():
        assert sa.attention(q, k, v, PLAN).grad_fn is None


def test_a_backend_that_drops_the_gradient_is_caught(monkeypatch):
    real = sdpa.forward
    detached = lambda *a, **kw: tuple(x if x is None else x.detach() for x in real(*a, **kw))
    monkeypatch.setattr(sdpa, "forward", detached)
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="'sdpa' returned an output without a gradient"):
        sa.attention(q, k, v, PLAN, backend="sdpa")


def test_gradients_through_a_paged_cache_are_refused():
    q, k, v = _inputs()
    kc, vc = (torch.randn(2, 16, 2, 16, device=DEV, requires_grad=True) for _ in range(2))
    bt = torch.tensor([[0], [1]], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="paged KV cache"):
        sa.attention(q, kc, vc, PLAN, block_table=bt, backend="reference")
