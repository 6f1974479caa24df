"""Device plans train: gradients through a DevicePlanner's plan equal the host plan's of the same
step (triton: bit for bit, its key tiles and column hulls built on the device; the dense
backends within their rounding), rows and keys past the step get zero gradients whatever they
hold, a rejected or poisoned sequence leaves the others' gradients unchanged, and the op path
(torch.compile) trains too."""

from __future__ import annotations

import pytest
import torch
from test_device_planner import DEV, LAYER, MIXED, _tensors, inputs, planner_for

import spanattn as sa

LAYERS = {"s": LAYER, "g": sa.LayerMask(spans="on"), "w": sa.LayerMask(window=3, spans="off")}
BATCHES = {
    "mixed": MIXED,
    "prefill": sa.Batch([sa.Seq(q_len=37, spans=[(3, 20)]), sa.Seq(q_len=18, kv_len=50, spans=[(40, 49)])]),
}


def padded(batch, planner, hq, hkv):
    """The step's q, k, v, and the same with NaN rows and keys up to the planner's capacity."""
    cap = planner.capacity
    return _tensors(batch, hq, hkv, 16, cap.max_tokens - batch.total_q, cap.max_kv_tokens - batch.total_k,
                    torch.float16)  # fmt: skip


def grads(q, k, v, plan, backend, dout, dlse):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = sa.attention(*leaves, plan, backend=backend, return_lse=True)
    n = dout.shape[0]
    return torch.autograd.grad((out[:n], lse[:n]), leaves, (dout, dlse))


def _backends():
    found = ["reference", "sdpa"]
    try:
        import triton  # noqa: F401

        found.append("triton")
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", list(BATCHES))
def test_device_plan_gradients_equal_the_host_plans(backend, name):
    batch = BATCHES[name]
    planner = planner_for(batch, LAYERS, slack=5)
    plans = planner.update(*inputs(batch))
    q, k, v, qp, kp, vp = padded(batch, planner, 4, 2)  # padding: NaN
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(q.dtype).to(DEV)
    dlse = torch.randn(q.shape[:2], generator=g).to(DEV)
    t, tk = batch.total_q, batch.total_k
    for layer_name, layer in LAYERS.items():
        want = grads(q, k, v, sa.plan(batch, layer, DEV), backend, dout, dlse)
        got = grads(qp, kp, vp, plans[layer_name], backend, dout, dlse)
        for w, x, n in zip(want, got, (t, tk, tk)):
            if backend == "triton":
                assert torch.equal(x[:n], w), layer_name
            else:  # the dense backends run the sequences at other offsets: torch's own rounding
                torch.testing.assert_close(x[:n], w, rtol=2e-3, atol=2e-3)
            assert torch.equal(x[n:], torch.zeros_like(x[n:])), "rows and keys past the step"


@pytest.mark.parametrize("backend", _backends())
def test_a_poisoned_sequence_leaves_the_others_gradients(backend):
    batch = BATCHES["prefill"]
    planner = planner_for(batch, LAYERS, slack=5)
    plan = planner.update(*inputs(batch))["s"]
    q, k, v, qp, kp, vp = padded(batch, planner, 2, 1)
    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:2], device=DEV)
    clean = grads(qp, kp, vp, plan, backend, dout, dlse)
    first_q, first_k = batch.seqs[0].q_len, batch.seqs[0].kv_len
    bad = [t.clone() for t in (qp, kp, vp)]
    for t, n in zip(bad, (first_q, first_k, first_k)):
        t[:n] = float("inf")
    poisoned = grads(*bad, plan, backend, dout, dlse)
    for c, p, n in zip(clean, poisoned, (first_q, first_k, first_k)):
        assert torch.equal(c[n:], p[n:])


def test_a_rejected_sequence_trains_nothing_and_leaves_the_others():
    # sequence 0's span ends before it starts: the planner rejects it (NaN rows); the others'
    # gradients equal the host plan's of the step without it
    pytest.importorskip("triton")
    batch = BATCHES["mixed"]
    planner = planner_for(batch, LAYERS, slack=5)
    q_lens, kv_lens, causal, spans = inputs(batch)
    spans = torch.cat([spans, spans.new_tensor([[0, 5, 2]])])
    plan = planner.update(q_lens, kv_lens, causal, spans)["s"]
    q, k, v, qp, kp, vp = padded(batch, planner, 2, 1)
    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:2], device=DEV)
    rows, keys = batch.seqs[0].q_len, batch.seqs[0].kv_len
    dout[:rows] = 0  # the rejected rows' outputs are NaN: no loss reads them
    dlse[:rows] = 0
    got = grads(qp, kp, vp, plan, "triton", dout, dlse)
    rest = sa.Batch(batch.seqs[1:])
    want = grads(q[rows:], k[keys:], v[keys:], sa.plan(rest, LAYER, DEV), "triton", dout[rows:], dlse[rows:])
    for x, w, n in zip(got, want, (rows, keys, keys)):
        assert torch.equal(x[n : n + w.shape[0]], w)


@pytest.mark.parametrize("backend", _backends())
def test_gradient_accumulation_across_planner_updates(backend):
    # step A's forward, the planner rewritten for step B, B's forward, one backward of both:
    # A's gradients come from A's plan (the forward kept a copy), not from the rewritten one
    a, b = BATCHES["prefill"], sa.Batch(BATCHES["prefill"].seqs[::-1])
    planner = planner_for(a, LAYERS, slack=5)
    *_, qp, kp, vp = padded(a, planner, 2, 1)
    leaves = [torch.nan_to_num(t, nan=0.0).requires_grad_() for t in (qp, kp, vp)]
    douts = [torch.randn(a.total_q, 2, 16, device=DEV).to(qp.dtype) for _ in range(2)]
    loss = 0
    for batch, dout in zip((a, b), douts):
        out = sa.attention(*leaves, planner.update(*inputs(batch))["s"], backend=backend)
        loss = loss + (out[: batch.total_q].float() * dout.float()).sum()
    got = torch.autograd.grad(loss, leaves)
    rows = (a.total_q, a.total_k, a.total_k)
    host = [t.detach()[:n].requires_grad_() for t, n in zip(leaves, rows)]
    loss = sum((sa.attention(*host, sa.plan(x, LAYER, DEV), backend=backend).float() * d.float()).sum()
               for x, d in zip((a, b), douts))  # fmt: skip
    want = torch.autograd.grad(loss, host)
    for x, w, n in zip(got, want, rows):
        if backend == "triton":
            assert torch.equal(x[:n], w)
        else:
            torch.testing.assert_close(x[:n], w, rtol=2e-3, atol=2e-3)


def test_device_plan_trains_under_torch_compile():
    pytest.importorskip("triton")
    batch = BATCHES["prefill"]
    planner = planner_for(batch, LAYERS, slack=5)
    plan = planner.update(*inputs(batch))["g"]
    q, k, v, qp, kp, vp = padded(batch, planner, 2, 1)
    qp, kp, vp = (torch.nan_to_num(t, nan=0.0) for t in (qp, kp, vp))
    dout = torch.randn(qp.shape, device=DEV).to(q.dtype)

    def step(q, k, v):
        return sa.attention(q, k, v, plan, backend="triton")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().requires_grad_() for t in (qp, kp, vp)]
    want = torch.autograd.grad(step(*leaves), leaves, dout)
    got = torch.autograd.grad(compiled(*leaves), leaves, dout)
    for w, x in zip(want, got):
        assert torch.equal(w, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_records_a_training_step_and_replays_new_steps():
    # forward and backward of a device plan captured once; the planner's updates between
    # replays change the step, and each replay's gradients equal the host plan's of that step
    pytest.importorskip("triton")
    batch = BATCHES["prefill"]
    planner = planner_for(batch, LAYERS, slack=5)
    plan = planner.update(*inputs(batch))["s"]
    *_, qp, kp, vp = padded(batch, planner, 2, 1)
    static = [torch.nan_to_num(t, nan=0.0).requires_grad_() for t in (qp, kp, vp)]
    dout = torch.randn(qp.shape, device=DEV).to(qp.dtype)

    def step():
        return torch.autograd.grad(sa.attention(*static, plan, backend="triton"), static, dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = step()
    for b in (sa.Batch(batch.seqs[::-1]), batch):
        planner.update(*inputs(b))
        graph.replay()
        rows = (b.total_q, b.total_k, b.total_k)
        leaves = [t.detach()[:n].requires_grad_() for t, n in zip(static, rows)]
        out = sa.attention(*leaves, sa.plan(b, LAYER, DEV), backend="triton")
        want = torch.autograd.grad(out, leaves, dout[: b.total_q])
        for x, w, n in zip(recorded, want, rows):
            assert torch.equal(x[:n], w)


def test_prepared_backward_tables_are_rebuilt_in_place_at_every_update():
    # DevicePlanner.prepare(backward=True): the key tiles and dQ's query tiles built once per
    # step into the same tensors (what a captured graph reads), equal to a fresh build, and
    # the gradients through them the host plan's
    pytest.importorskip("triton")
    from spanattn.backends.triton.configs import pick_backward
    from spanattn.backends.triton.kernel import INTERPRETED
    from spanattn.backends.triton.key_schedule import build_key_schedule

    a, b = BATCHES["prefill"], sa.Batch(BATCHES["prefill"].seqs[::-1])
    planner = planner_for(a, LAYERS, slack=5)
    planner.prepare("triton", head_dim=16, dtype=torch.float16, group=2, backward=True)
    dkdv, _ = pick_backward(16, torch.float16, INTERPRETED)
    key = ("triton.key_tiles", dkdv.block_m, dkdv.block_n, True)
    table = None
    for batch in (a, b):
        plan = planner.update(*inputs(batch))["s"]
        assert table is None or plan.tables[key] is table
        table = plan.tables[key]
        assert torch.equal(table.info, build_key_schedule(plan, dkdv.block_m, dkdv.block_n).info)
        *_, qp, kp, vp = padded(batch, planner, 2, 1)
        dout, dlse = torch.randn(batch.total_q, 2, 16, device=DEV).to(qp.dtype), torch.zeros(batch.total_q, 2)
        got = grads(qp, kp, vp, plan, "triton", dout, dlse.to(DEV))
        q, k, v = (t[:n] for t, n in zip((qp, kp, vp), (batch.total_q, batch.total_k, batch.total_k)))
        want = grads(q, k, v, sa.plan(batch, LAYER, DEV), "triton", dout, dlse.to(DEV))
        for x, w in zip(got, want):
            assert torch.equal(x[: w.shape[0]], w)
