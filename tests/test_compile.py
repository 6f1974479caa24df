"""torch.compile of code that calls the public API (sa.attention, sa.write_kv_cache): one graph
(``fullgraph=True`` fails on any graph break), outputs equal to eager, and with dynamic shapes
no recompilation over 50 steps of different lengths, spans and batch compositions for one layer
kind (``error_on_recompile`` from the second step on). CPU: the reference backend inside
aot_eager keeps it quick; inductor and the triton interpreter once each."""

import random

import pytest
import torch

import spanattn as sa
from spanattn.cache import slot_mapping

LAYER = sa.LayerMask(window=8, spans="clamp")
PAGE, BLOCKS, WIDTH = 16, 40, 6


# The first step: every size distinct from the others (and from heads, head_dim, pages). With
# dynamic shapes torch.compile gives sizes that are equal on its first call one symbol ("duck
# sizing"), a guard that a later step with unequal sizes fails.
FIRST = [sa.Seq(q_len=20, kv_len=50, spans=[(10, 29)]), sa.Seq(q_len=1, kv_len=30), sa.Seq(14, causal=False)]


def random_step(seed: int):
    """A step of 2-4 sequences (chunks, decode rows, canvases, an image span or none), with
    packed q/k/v, and block tables naming pages of a cache for the same keys. (A size of 1, one
    sequence or one query, torch.compile specializes, as any size 0 or 1.)"""
    r = random.Random(seed)
    seqs = [] if seed else FIRST
    for _ in range(r.randint(2, 4) if seed else 0):
        kv = r.randint(2, 60)
        q = r.choice([1, kv, r.randint(1, kv)])
        spans = []
        if r.random() < 0.6 and kv > 8:
            s = r.randint(0, kv - 5)
            spans = [(s, min(kv - 1, s + r.randint(0, 12)))]
        seqs.append(sa.Seq(q_len=q, kv_len=kv, spans=spans, causal=r.random() < 0.7))
    plan = sa.plan(sa.Batch(seqs), LAYER)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(plan.total_q, 8, 16, generator=g)
    k, v = torch.randn(2, plan.total_k, 2, 16, generator=g)
    ids = torch.randperm(BLOCKS, generator=g)[: len(seqs) * WIDTH].view(len(seqs), WIDTH).to(torch.int32)
    return plan, q, k, v, ids


def packed(q, k, v, plan):
    out, lse = sa.attention(q, k, v, plan, backend="reference", return_lse=True)
    return torch.cat([out * 2, lse[..., None] - 1], -1)  # exact arithmetic: inductor's equals eager's


def paged(q, k_new, v_new, kc, vc, slots, bt, plan):
    sa.write_kv_cache(k_new, v_new, kc, vc, slots)
    return sa.attention(q, kc, vc, plan, block_table=bt, backend="reference") + 1


def _run(fn, compiled, seed):
    plan, q, k, v, bt = random_step(seed)
    if fn is packed:
        args = (q, k, v, plan)
    else:  # every key is new: the step writes them all, then attends over the cache
        full = sa.plan(sa.Batch([sa.Seq(q_len=s.kv_len) for s in plan.batch.seqs]), sa.LayerMask())
        kc = torch.zeros(BLOCKS, PAGE, 2, 16)
        args = (q, k, v, kc, kc.clone(), slot_mapping(full, bt, PAGE), bt, plan)
    want = fn(*[a.clone() if torch.is_tensor(a) else a for a in args])
    assert torch.equal(compiled(*args), want), seed


@pytest.mark.parametrize("fn", [packed, paged])
def test_fifty_steps_one_graph_no_recompile(fn):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    _run(fn, compiled, 0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(1, 50):
            _run(fn, compiled, seed)


def test_inductor_fullgraph():
    torch._dynamo.reset()
    compiled = torch.compile(packed, fullgraph=True, dynamic=True)
    for seed in range(3):
        _run(packed, compiled, seed)


def test_device_plan_with_triton_compiles_once():
    """A device plan's tensors keep their shapes from step to step: one graph for every step."""
    pytest.importorskip("triton")
    torch._dynamo.reset()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    planner = sa.DevicePlanner({"l": LAYER}, max_seqs=4, max_tokens=64, max_kv_len=64, max_spans=4,
                               max_kv_tokens=256, device=dev)  # fmt: skip
    planner.prepare("triton", head_dim=16, dtype=torch.float16, group=4)

    def fn(q, k, v, plan):
        return sa.attention(q, k, v, plan, backend="triton") * 2

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        plan, q, k, v, _ = random_step(seed)
        plan, (q, k, v) = sa.plan(plan.batch, LAYER, device=dev), (x.to(dev) for x in (q, k, v))
        seqs = plan.batch.seqs
        t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
        spans = t([(i, a, b) for i, s in enumerate(seqs) for a, b in s.spans]).view(-1, 3)
        dplan = planner.update(t([s.q_len for s in seqs]), t([s.kv_len for s in seqs]),
                               t([s.causal for s in seqs]), spans)["l"]  # fmt: skip
        pad = lambda x, n: torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])]).half()
        qp, kp, vp = pad(q, 64), pad(k, 256), pad(v, 256)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got = compiled(qp, kp, vp, dplan)
        want = fn(q.half(), k.half(), v.half(), plan)
        assert torch.equal(got[: plan.total_q], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA graphs")
def test_host_plans_under_cuda_graphs_follow_each_call():
    """``mode="reduce-overhead"`` (inductor's CUDA graphs) around steps on host plans: two plans of
    the same shapes and different masks, called in turn with new inputs, each output equal to the
    eager call's bit for bit (a recorded step replayed for the other plan would not be), also on
    Hopper's persistent Gluon kernels (their tile tables and item counters made on first use)."""
    pytest.importorskip("triton")
    batch = sa.Batch([sa.Seq(q_len=300, kv_len=700, spans=[(128, 255)]), sa.Seq(q_len=200, kv_len=200)])
    plans = [sa.plan(batch, layer, device="cuda") for layer in (sa.LayerMask(), LAYER)]

    def step(q, k, v, plan):
        return sa.attention(q, k, v, plan, backend="triton") * 2  # CUDA work for a graph around the op

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(6):
        plan = plans[i % 2]
        q = torch.randn(plan.total_q, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = torch.randn(2, plan.total_k, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
        got = compiled(q, k, v, plan).clone()  # a graph's output is overwritten by its next replay
        assert torch.equal(got, step(q, k, v, plan)), i
