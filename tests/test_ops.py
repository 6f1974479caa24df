"""The torch ops (ops.py) under torch.library.opcheck: schema (no input mutated or aliased
unless declared), fake implementation (outputs' shapes, dtypes and strides under FakeTensorMode),
autograd registration, and AOT dispatch with static and dynamic shapes (the compiled op equals
the eager op). Tiny steps, for the reference, sdpa and triton (interpreter) backends, packed and
paged K/V, host and device plans; and the cache write."""

import pytest
import torch
from test_paged import paged_step

import spanattn as sa
from spanattn import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STEP = sa.Batch(
    [sa.Seq(q_len=5, kv_len=21, spans=[(12, 18)]), sa.Seq(q_len=1, kv_len=9), sa.Seq(3, causal=False)]
)
LAYER = sa.LayerMask(window=6, spans="clamp")
OPS = (ops.attention_op, ops.attention_lse_op)  # device plans
HOST_OPS = (ops.host_attention_op, ops.host_attention_lse_op)


def _args(q, k, v, plan, block_table, backend):
    if isinstance(plan, sa.Plan):
        return (q, k, v, plan.lo, plan.hi, None, None, None, [], block_table, plan.handle, "", backend,
                0.3, None)  # fmt: skip
    return (q, k, v, plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens,
            plan.op_tables, block_table, None, plan.op_meta, backend, 0.3, None)  # fmt: skip


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton"])
def test_attention_ops_pass_opcheck(backend, paged):
    if backend == "triton":
        pytest.importorskip("triton")
    p, q, k, v, kc, vc, bt = paged_step(STEP, LAYER, 2, 1, 16, 16, torch.float16)
    kv = (kc, vc, bt) if paged else (k, v, None)
    for op in HOST_OPS:
        torch.library.opcheck(op, _args(q, kv[0], kv[1], p, kv[2], backend))
    out = ops.host_attention_op(*_args(q, kv[0], kv[1], p, kv[2], backend))
    want = sa.attention(q, kv[0], kv[1], p, block_table=kv[2], backend=backend, scale=0.3)
    assert torch.equal(out, want)


@pytest.mark.parametrize("max_q_len", [None, 5], ids=["prefill", "decode"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_ops_pass_opcheck_on_device_plans(backend, max_q_len):
    if backend == "triton":
        pytest.importorskip("triton")
    p, q, k, v, kc, vc, bt = paged_step(STEP, LAYER, 2, 1, 16, 16, torch.float16)
    # every token row used (outputs of padding rows are undefined), padding sequences and spans
    planner = sa.DevicePlanner(
        {"l": LAYER}, max_seqs=5, max_tokens=STEP.total_q, max_kv_len=32, max_spans=3, max_q_len=max_q_len,
        device=DEV,
    )  # fmt: skip
    planner.prepare(backend, head_dim=16, dtype=torch.float16, group=2)
    t = lambda x: torch.tensor(x, device=DEV)
    plan = planner.update(t([5, 1, 3]), t([21, 9, 3]), t([1, 1, 0]), t([[0, 12, 18]]))["l"]
    bt = torch.cat([bt, bt[:1].expand(2, -1)])  # rows of padding sequences: never read
    for op in OPS:
        torch.library.opcheck(op, _args(q, kc, vc, plan, bt, backend))


def test_write_kv_cache_op_passes_opcheck():
    kc = torch.zeros(4, 16, 2, 8, device=DEV)
    k, v = torch.randn(5, 2, 8, device=DEV), torch.randn(5, 2, 8, device=DEV)
    slots = torch.tensor([3, -1, 17, 40, 63], device=DEV)
    torch.library.opcheck(ops.write_kv_cache_op, (k, v, kc, kc.clone(), slots, None))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_device_plan_ops_pass_opcheck_with_gradients(backend):
    # a device plan trains: its ops differentiated (eager and through AOT dispatch), and the
    # backward op that reads the plan's tensors and encoding
    if backend == "triton":
        pytest.importorskip("triton")
    p, q, k, v, *_ = paged_step(STEP, LAYER, 2, 1, 16, 16, torch.float32)
    planner = sa.DevicePlanner({"l": LAYER}, max_seqs=3, max_tokens=STEP.total_q, max_kv_len=32, max_spans=3,
                               max_kv_tokens=STEP.total_k, device=DEV)  # fmt: skip
    t = lambda x: torch.tensor(x, device=DEV)
    plan = planner.update(t([5, 1, 3]), t([21, 9, 3]), t([1, 1, 0]), t([[0, 12, 18]]))["l"]
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    for op in OPS:
        torch.library.opcheck(op, (*_args(q, k, v, plan, None, backend), "deferred", True))
    out, lse = ops.attention_lse_op(*_args(q, k, v, plan, None, backend), "deferred", True)
    saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    tensors = (plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens, plan.op_tables)
    args = (torch.randn_like(out), torch.randn_like(lse), *saved, *tensors, plan.op_meta, backend, 0.3, None)
    torch.library.opcheck(sa.grad.device_backward_op, args)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_host_plan_ops_pass_opcheck_with_gradients(backend):
    # opcheck differentiates the ops (eager and through AOT dispatch) and the backward op
    p, q, k, v, *_ = paged_step(STEP, LAYER, 2, 1, 16, 16, torch.float32)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    for op in HOST_OPS:
        torch.library.opcheck(op, (*_args(q, k, v, p, None, backend), "deferred", True))
    out, lse = ops.host_attention_lse_op(*_args(q, k, v, p, None, backend), "deferred", True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    saved = (q.detach(), k.detach(), v.detach(), out.detach(), lse.detach())
    args = (dout, dlse, *saved, p.handle, backend, 0.3, None)
    torch.library.opcheck(sa.grad.backward_op, args)


@pytest.mark.parametrize("return_lse", [False, True])
def test_compiled_steps_call_the_op_of_their_plan_kind(return_lse):
    """A host plan's step goes to the op CUDA graphs never record (its kernels' arguments come
    from the plan at call time: a replay would repeat the recorded step's), a device plan's to
    the replayable one."""
    p, q, k, v, *_ = paged_step(STEP, LAYER, 2, 1, 16, 16, torch.float32)
    planner = sa.DevicePlanner({"l": LAYER}, max_seqs=3, max_tokens=STEP.total_q, max_kv_len=32, max_spans=3,
                               max_kv_tokens=STEP.total_k, device=DEV)  # fmt: skip
    t = lambda x: torch.tensor(x, device=DEV)
    dp = planner.update(t([5, 1, 3]), t([21, 9, 3]), t([1, 1, 0]), t([[0, 12, 18]]))["l"]

    def ops_called(plan) -> list[str]:
        graphs = []
        torch._dynamo.reset()
        step = torch.compile(lambda *a: sa.attention(*a, backend="reference", return_lse=return_lse),
                             backend=lambda gm, inputs: graphs.append(gm) or gm, fullgraph=True)  # fmt: skip
        step(q, k, v, plan)
        return [str(n.target) for n in graphs[0].graph.nodes if "spanattn" in str(n.target)]

    lse = "_lse" if return_lse else ""
    assert ops_called(p) == [f"spanattn.attention{lse}_host_plan.default"]
    assert ops_called(dp) == [f"spanattn.attention{lse}.default"]
    tagged = hasattr(torch.Tag, "cudagraph_unsafe")
    assert all((torch.Tag.cudagraph_unsafe in op._opoverload.tags) == tagged for op in HOST_OPS)
    assert not tagged or all(torch.Tag.cudagraph_unsafe not in op._opoverload.tags for op in OPS)
