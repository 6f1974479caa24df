"""Gradients through spanattn.attention's autograd paths (api.py, dispatch.py, grad.py, ops.py): torch's
autograd through a dense backend's forward (eager), and the torch op's own backward
(``spanattn::attention_backward``: torch.compile, and eager calls of the kernel backends),
which must agree; gradcheck in float64; torch.compile(fullgraph=True) forward and backward;
activation checkpointing; autocast; non-contiguous output gradients; the LSE's gradient.
The kernels' gradients against the fp64 truth: test_triton_backward.py and test_grad_rule.py."""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import spanattn as sa
from spanattn.backends import reference, sdpa

STEP = sa.Batch([sa.Seq(q_len=7, kv_len=12, spans=[(3, 9)]), sa.Seq(5, causal=False), sa.Seq(1, kv_len=6)])
LAYERS = {"clamp": sa.LayerMask(window=4, spans="clamp"), "on": sa.LayerMask(spans="on")}
GROUPED = sa.Batch([sa.Seq(q_len=12, spans=[(1, 3, 0), (6, 8, 0)]), sa.Seq(4)])


def inputs(plan, dtype=torch.float64, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((plan.total_q, hq), (plan.total_k, hkv), (plan.total_k, hkv))
    return [torch.randn(n, h, d, generator=g, dtype=dtype).requires_grad_() for n, h in shapes]


def loss(out, lse):
    # weights every output element and LSE differently: a gradient in the wrong place shows
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * w).sum() + (lse.to(out.dtype) * torch.linspace(0.5, 2, lse.numel()).view(lse.shape)).sum()


def grads(fn, plan, tensors, **opts):
    q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
    out, lse = fn(q, k, v, plan, return_lse=True, **opts)
    loss(out, lse).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.fixture
def through_the_op(monkeypatch):
    """Eager calls of the dense backends through the torch op's backward, as the kernels' run."""
    for mod in (reference, sdpa):
        monkeypatch.setattr(mod, "NATIVE_AUTOGRAD", False)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("layer", LAYERS, ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_ops_backward_equals_autograd_through_the_forward(backend, layer, softcap, monkeypatch):
    if backend == "sdpa" and softcap:
        pytest.skip("sdpa has no softcap")
    plan = sa.plan(STEP, LAYERS[layer])
    tensors = inputs(plan)
    opts = dict(backend=backend, softcap=softcap, scale=0.37)
    native = grads(sa.attention, plan, tensors, **opts)
    monkeypatch.setattr(sa.backends.load(backend), "NATIVE_AUTOGRAD", False)
    through_op = grads(sa.attention, plan, tensors, **opts)
    for a, b in zip(native, through_op):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_span_groups_backward_equals_autograd(monkeypatch):
    plan = sa.plan(GROUPED, sa.LayerMask(window=3, spans="clamp"))
    tensors = inputs(plan, hq=2, hkv=1)
    native = grads(sa.attention, plan, tensors, backend="reference")
    monkeypatch.setattr(reference, "NATIVE_AUTOGRAD", False)
    for a, b in zip(native, grads(sa.attention, plan, tensors, backend="reference")):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_gradcheck_in_float64(softcap, through_the_op):
    plan = sa.plan(sa.Batch([sa.Seq(q_len=4, kv_len=6, spans=[(2, 4)]), sa.Seq(3, causal=False)]),
                   sa.LayerMask(window=2, spans="clamp"))  # fmt: skip
    q, k, v = inputs(plan, hq=2, hkv=1, d=4)
    fn = lambda q, k, v: sa.attention(q, k, v, plan, backend="reference", softcap=softcap, return_lse=True)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_the_op_without_an_lse_recomputes_it(through_the_op):
    plan = sa.plan(STEP, LAYERS["clamp"])
    tensors = inputs(plan)
    q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
    args = (q, k, v, plan.lo, plan.hi, None, None, None, [], None, plan.handle, "", "reference", None, None)
    (sa.ops.host_attention_op(*args) * 1.5).sum().backward()
    for a, b in zip((q, k, v), _grad_of_sum(plan, tensors)):
        torch.testing.assert_close(a.grad, b * 1.5, rtol=1e-12, atol=1e-12)


def _grad_of_sum(plan, tensors):
    q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
    sa.attention(q, k, v, plan, backend="reference").sum().backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_compiled_forward_and_backward_in_one_graph(backend):
    plan = sa.plan(STEP, LAYERS["clamp"])
    tensors = inputs(plan, dtype=torch.float32)
    eager = grads(sa.attention, plan, tensors, backend=backend)
    compiled = torch.compile(sa.attention, fullgraph=True, backend="aot_eager")
    for a, b in zip(eager, grads(compiled, plan, tensors, backend=backend)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_training_step_reuses_its_graph_across_steps():
    # a new step (other lengths and spans, the same layer kind) is new data for the graph
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, p: sa.attention(q, k, v, p, backend="reference").sum(), dynamic=True,
                       fullgraph=True, backend="aot_eager")  # fmt: skip
    steps = ([sa.Seq(9, spans=[(2, 5)]), sa.Seq(7)], [sa.Seq(14, spans=[(4, 10)]), sa.Seq(3)],
             [sa.Seq(11), sa.Seq(5, causal=False)])  # fmt: skip
    for i, seqs in enumerate(steps):
        plan = sa.plan(sa.Batch(seqs), LAYERS["clamp"])
        q, k, v = inputs(plan, dtype=torch.float32, seed=i)
        with torch._dynamo.config.patch(error_on_recompile=i > 1):
            fn(q, k, v, plan).backward()
        want = _grad_of_sum(plan, (q, k, v))
        for a, b in zip((q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(reentrant, through_the_op):
    plan = sa.plan(STEP, LAYERS["on"])
    tensors = inputs(plan, dtype=torch.float32)
    plain = grads(sa.attention, plan, tensors, backend="reference")

    def block(q, k, v, plan, **opts):  # the forward runs without saving anything, again in the backward
        return sa.attention(q * 1.0, k, v, plan, **opts)

    def ckpt(q, k, v, plan, **opts):  # the reentrant form takes no keyword arguments
        return checkpoint(functools.partial(block, **opts), q, k, v, plan, use_reentrant=reentrant)

    for a, b in zip(plain, grads(ckpt, plan, tensors, backend="reference")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_autocast_runs_in_its_dtype_and_returns_float32_gradients():
    plan = sa.plan(STEP, LAYERS["clamp"])
    q, k, v = inputs(plan, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sa.attention(q, k, v, plan, backend="reference")
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32
    q2, k2, v2 = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    sa.attention(q2, k2, v2, plan, backend="reference").float().square().sum().backward()
    for a, b in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad)):
        assert torch.equal(a, b.float())


def test_non_contiguous_output_gradients(through_the_op):
    plan = sa.plan(STEP, LAYERS["clamp"])
    tensors = inputs(plan)
    q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
    out = sa.attention(q, k, v, plan, backend="reference")
    dout = torch.randn(out.shape[2], out.shape[1], out.shape[0], dtype=out.dtype).permute(2, 1, 0)
    out.backward(dout)
    want = [t.detach().clone().requires_grad_() for t in tensors]
    torch.autograd.backward(sa.attention(*want, plan, backend="reference"), dout.contiguous())
    for a, b in zip((q, k, v), want):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    q.grad = None
    sa.attention(q, k, v, plan, backend="reference").sum().backward()  # dout expanded: stride 0
    torch.testing.assert_close(q.grad, _grad_of_sum(plan, tensors)[0], rtol=1e-12, atol=1e-12)
