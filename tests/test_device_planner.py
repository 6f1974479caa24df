"""Device plans (device_planner.py): planning from per-sequence tensors into fixed-capacity buffers.

The host plan of the same step is the oracle: intervals, offsets and attention outputs must be
equal exactly on the step's rows. Rules spec.py enforces on the host are checked on the device
per sequence: a broken sequence is recorded and NaN-poisoned, and every other sequence's rows
stay exactly what they would be without it. The triton kernels run under TRITON_INTERPRET=1
without a GPU."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import batches, layers

import spanattn as sa
from spanattn.device_rules import COLUMN
from spanattn.intervals import compute_intervals

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(batch: sa.Batch, shuffle_seed=None, pad_rows=0):
    """The step as an engine holds it: per-sequence tensors and span rows (seq, start, end),
    optionally shuffled and with padding rows (sequence -1) among them."""
    spans = [(i, s, e) for i, seq in enumerate(batch.seqs) for s, e in seq.spans]
    spans += [(-1, 7, 3)] * pad_rows
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(spans)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
    return (
        t([s.q_len for s in batch.seqs]),
        t([s.kv_len for s in batch.seqs]),
        t([s.causal for s in batch.seqs]),
        t(spans).view(-1, 3),
    )


def planner_for(batch, layer_map, slack=3, **kw):
    spans = sum(len(s.spans) for s in batch.seqs)
    opts = dict(
        max_seqs=len(batch) + slack, max_tokens=batch.total_q + slack, max_spans=spans + slack + 2,
        max_kv_len=max(s.kv_len for s in batch.seqs) + slack, max_kv_tokens=batch.total_k + slack,
        allow_split_spans=batch.allow_split_spans, device=DEV,
    )  # fmt: skip
    return sa.DevicePlanner(layer_map, **{**opts, **kw})


def assert_matches_host(batch, layer, dplan):
    host = sa.plan(batch, layer, device=DEV)
    n, t = len(batch), batch.total_q
    assert torch.equal(dplan.lo[:t], host.lo) and torch.equal(dplan.hi[:t], host.hi)
    assert (dplan.lo[t:] == 0).all() and (dplan.hi[t:] == -1).all()  # padding rows: empty
    assert torch.equal(dplan.cu_seqlens_q[: n + 1], host.cu_seqlens_q)
    assert torch.equal(dplan.cu_seqlens_k[: n + 1], host.cu_seqlens_k)
    assert torch.equal(dplan.seq_lens[:n], host.seq_lens) and (dplan.seq_lens[n:] == 0).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_seqs=5), layer=layers(), seed=st.integers(0, 99), pad=st.integers(0, 2))
def test_device_plan_equals_host_plan(batch, layer, seed, pad):
    planner = planner_for(batch, {"l": layer})
    plans = planner.update(*inputs(batch, shuffle_seed=seed, pad_rows=pad))
    assert not planner.errors.any()
    assert_matches_host(batch, layer, plans["l"])
    planner.check()


def test_fused_kernel_equals_torch_on_device_steps():
    """intervals_triton's PADDED lowering against intervals_torch on the planner's own step."""
    pytest.importorskip("triton")
    batch = sa.Batch(
        [sa.Seq(q_len=7, kv_len=30, spans=[(20, 29), (3, 9)]), sa.Seq(2), sa.Seq(5, causal=False)]
    )
    for layer in (sa.LayerMask(window=4, spans="clamp"), sa.LayerMask(spans="on"), sa.LayerMask(window=2)):
        planner = planner_for(batch, {"l": layer})
        bad = inputs(batch)
        bad[1][1] = 1  # kv_len < q_len: a rejected sequence, empty rows
        planner.update(*bad)
        want = compute_intervals(layer, planner._step, planner.capacity.max_tokens, fused=False)
        got = compute_intervals(layer, planner._step, planner.capacity.max_tokens, fused=True)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


CLEAN = sa.Batch(
    [
        sa.Seq(q_len=6, kv_len=20, spans=[(4, 9)]),
        sa.Seq(q_len=3, kv_len=12, spans=[(0, 2), (5, 11)]),
        sa.Seq(q_len=4, kv_len=4, causal=False),
    ]
)
LAYER = sa.LayerMask(window=5, spans="clamp")


def _break(rule):
    """Clean inputs with sequence 1 broken by ``rule``: (q_lens, kv_lens, causal, spans, planner kw)."""
    q, kv, causal, spans = inputs(CLEAN)
    kw = {}
    if rule == "lengths":
        kv[1] = 2
    elif rule == "max_q_len":
        kw["max_q_len"] = 6
        q[1], kv[1] = 7, 12
    elif rule == "max_kv_len":
        kw["max_kv_len"] = 20
        kv[1] = 21
    elif rule == "span":
        spans[1] = torch.tensor([1, 3, 1])
    elif rule == "overlap":
        spans = torch.cat([spans, torch.tensor([[1, 2, 4]], dtype=torch.int32, device=DEV)])
    elif rule == "cut":
        spans[2] = torch.tensor([1, 5, 14])
    elif rule == "int32":  # int64 inputs whose int32 wrap would read as a valid sequence
        q, kv, spans = q.long(), kv.long(), spans.long()
        kv[1] = 2**32 + 12
    return q, kv, causal, spans, kw


@pytest.mark.parametrize("rule", ["lengths", "max_q_len", "max_kv_len", "span", "overlap", "cut", "int32"])
def test_a_broken_sequence_poisons_only_itself(rule):
    q, kv, causal, spans, kw = _break(rule)
    planner = planner_for(CLEAN, {"l": LAYER}, slack=5, **{"max_kv_tokens": None, **kw})
    plan = planner.update(q, kv, causal, spans)["l"]
    errors = planner.errors.cpu()
    assert errors[1, COLUMN[rule]] and errors.sum() == errors[1].sum()  # only sequence 1
    host = sa.plan(CLEAN, LAYER, device=DEV)
    cu = plan.cu_seqlens_q.tolist()
    for i in (0, 2):  # the others: their rows exactly as in the clean plan
        rows, want = slice(cu[i], cu[i + 1]), host.seq_slice(i)
        assert torch.equal(plan.lo[rows], host.lo[want]) and torch.equal(plan.hi[rows], host.hi[want])
    assert (plan.lo[cu[1] : cu[2]] == 0).all() and (plan.hi[cu[1] : cu[2]] == -1).all()
    assert plan.seq_lens[1] == 0
    with pytest.raises(ValueError, match=f"sequence 1 .*{_message(rule)}"):
        planner.check()


def _message(rule):
    return {"lengths": "kv_len >= q_len", "max_q_len": "max_q_len=6", "max_kv_len": "max_kv_len=20",
            "span": "negative start", "overlap": "overlap", "cut": "allow_split_spans",
            "int32": "outside int32"}[rule]  # fmt: skip


def test_capacity_overflow_and_foreign_spans():
    """Queries past max_tokens poison the sequences that reach there; a span naming a sequence
    past max_seqs is the step's error; keys past max_kv_tokens poison their sequence."""
    planner = sa.DevicePlanner(
        {"l": LAYER}, max_seqs=3, max_tokens=10, max_kv_len=30, max_spans=2, max_kv_tokens=40, device=DEV
    )
    t = lambda x: torch.tensor(x, device=DEV)
    plan = planner.update(t([4, 5, 3]), t([4, 30, 8]), spans=t([[5, 0, 1]]))["l"]
    err = planner.errors.cpu()
    assert err[2, COLUMN["max_tokens"]] and err[2, COLUMN["max_kv_tokens"]] and err[3, COLUMN["span_seq"]]
    assert not err[:2].any()
    assert plan.cu_seqlens_q.tolist() == [0, 4, 9, 10] and plan.cu_seqlens_k.tolist() == [0, 4, 34, 40]
    assert plan.hi[9] == -1 and plan.hi[:9].min() >= 0
    with pytest.raises(ValueError, match="the step: a span names a sequence >= max_seqs=3"):
        planner.check()


def test_values_outside_int32_are_rejected_not_truncated():
    """int64 lengths and span bounds past int32 were copied wrapped into the int32 buffers
    (``2**32 + 3`` planned as 3): now the sequence is rejected and check() names it; a span row
    whose sequence number does not fit is the step's error (it named sequence 0 once wrapped)."""
    planner = sa.DevicePlanner(
        {"l": LAYER}, max_seqs=3, max_tokens=16, max_kv_len=32, max_spans=2, max_kv_tokens=64, device=DEV
    )
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)
    # sequence 1 last: the sequences after it would run past max_tokens (offsets follow lengths)
    plan = planner.update(t([2, 2**32 + 3]), t([8, 2**32 + 5]), spans=t([[2**32, 0, 1]]))["l"]
    err = planner.errors.cpu()
    assert err[1, COLUMN["int32"]] and err[3, COLUMN["int32"]] and not err[0].any()
    assert plan.seq_lens[0] == 8 and plan.seq_lens[1] == 0  # sequence 0 is planned, 1 is not
    with pytest.raises(
        ValueError, match=r"sequence 1 \(q_len 2147483647, kv_len 2147483647\): .*outside int32"
    ):
        planner.check()
    planner.update(t([3, 2]), t([5, 8]), spans=t([[1, 0, 2**31]]))  # a span end past int32
    err = planner.errors.cpu()
    assert err[1, COLUMN["int32"]] and not err[0].any() and not err[3].any()
    planner.update(t([3, 2]), t([5, 8]), causal=t([2**32, 1]))  # a flag clamped keeps its truth
    assert not planner.errors.any()
    assert planner.plans["l"].hi[:3].tolist() == sa.plan(sa.Batch([sa.Seq(3, kv_len=5)]), LAYER).hi.tolist()


def test_update_argument_errors():
    planner = sa.DevicePlanner({"l": LAYER}, max_seqs=2, max_tokens=8, max_kv_len=8, max_spans=1, device=DEV)
    t = lambda x: torch.tensor(x, device=DEV)
    with pytest.raises(ValueError, match="q_lens has 3 rows, more than max_seqs=2"):
        planner.update(t([1, 1, 1]), t([1, 1, 1]))
    with pytest.raises(ValueError, match=r"spans must be a \[m, 3\] tensor"):
        planner.update(t([1]), t([1]), spans=t([1, 2]))
    with pytest.raises(TypeError, match="q_lens must hold integers"):
        planner.update(t([1.0]), t([1]))
    with pytest.raises(
        TypeError, match=r"kv_lens must hold integers \(int32 or int64; no bools\), got torch.bool"
    ):
        planner.update(t([1]), t([True]))
    with pytest.raises(ValueError, match="DevicePlanner.max_kv_len = 4294967296 is over 2147483647"):
        sa.DevicePlanner({"l": LAYER}, max_seqs=2, max_tokens=8, max_kv_len=2**32)
    missing = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"DevicePlanner\(device=...\) = '{missing}', but "):
        sa.DevicePlanner({"l": LAYER}, max_seqs=1, max_tokens=1, max_kv_len=1, device=missing)
    with pytest.raises(ValueError, match="DevicePlanner.max_q_len must be >= 1, got 0"):
        sa.DevicePlanner({"l": LAYER}, max_seqs=2, max_tokens=8, max_kv_len=8, max_q_len=0)
    with pytest.raises(TypeError, match=r"layers\['l'\] must be a spanattn.LayerMask"):
        sa.DevicePlanner({"l": "causal"}, max_seqs=2, max_tokens=8, max_kv_len=8)


@pytest.mark.parametrize("backend", ["fa4", "flex"])
def test_backends_without_device_plans_refuse_by_name(backend):
    planner = planner_for(CLEAN, {"l": LAYER})
    plan = planner.update(*inputs(CLEAN))["l"]
    q = torch.randn(plan.total_q, 2, 16, device=DEV)
    k = v = torch.randn(planner.capacity.max_kv_tokens, 1, 16, device=DEV)
    with pytest.raises(RuntimeError, match=f"backend='{backend}' cannot run this call: .*plan on the host"):
        sa.attention(q, k, v, plan, backend=backend)
    with pytest.raises(ValueError, match=f"backend='{backend}' cannot run a device plan"):
        planner.prepare(backend, head_dim=16)


def _tensors(batch, hq, hkv, d, extra_q, extra_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda n, h: torch.randn(n, h, d, generator=g).to(dtype).to(DEV)
    q, k, v = r(batch.total_q, hq), r(batch.total_k, hkv), r(batch.total_k, hkv)
    nan = lambda n, h: torch.full((n, h, d), float("nan"), dtype=dtype, device=DEV)
    return (
        q,
        k,
        v,
        torch.cat([q, nan(extra_q, hq)]),
        torch.cat([k, nan(extra_k, hkv)]),
        torch.cat([v, nan(extra_k, hkv)]),
    )


MIXED = sa.Batch(
    [sa.Seq(q_len=20, kv_len=45, spans=[(30, 44)]), sa.Seq(q_len=1, kv_len=23), sa.Seq(9, causal=False)]
)
DECODE = sa.Batch(
    [sa.Seq(q_len=1, kv_len=70), sa.Seq(q_len=3, kv_len=40, spans=[(35, 39)]), sa.Seq(q_len=2, kv_len=9)]
)


@pytest.mark.parametrize("batch, max_q_len", [(MIXED, None), (DECODE, 4)], ids=["prefill", "decode"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_attention_equals_host_plan_packed(batch, max_q_len, backend):
    """Rows of the step are exact; a second step through the same planner (its prepared tables
    rebuilt in place) is exact too; a poisoned sequence's rows are NaN, the others unchanged."""
    if backend == "triton":
        pytest.importorskip("triton")
    layers = {"s": LAYER, "g": sa.LayerMask(spans="on")}
    planner = planner_for(batch, layers, slack=5, max_q_len=max_q_len)
    planner.prepare(backend, head_dim=16, dtype=torch.float16, group=2)
    for step in (sa.Batch(batch.seqs[::-1]), batch):
        plans = planner.update(*inputs(step))
        q, k, v, qp, kp, vp = _tensors(step, 2, 1, 16, 5, 5, torch.float16)
        for name, layer in layers.items():
            want = sa.attention(q, k, v, sa.plan(step, layer, DEV), backend=backend, return_lse=True)
            got = sa.attention(qp, kp, vp, plans[name], backend=backend, return_lse=True)
            assert torch.equal(got[0][: step.total_q], want[0]) and torch.equal(
                got[1][: step.total_q], want[1]
            )
    q_lens, kv_lens, causal, spans = inputs(batch)
    spans = torch.cat([spans, spans.new_tensor([[0, 5, 2]])])  # sequence 0: a span ending before it starts
    out = sa.attention(qp, kp, vp, planner.update(q_lens, kv_lens, causal, spans)["s"], backend=backend)
    rows = batch.seqs[0].q_len
    want = sa.attention(q, k, v, sa.plan(batch, LAYER, DEV), backend=backend)
    assert out[:rows].isnan().all() and torch.equal(out[rows : batch.total_q], want[rows:])


@pytest.mark.parametrize("batch, max_q_len", [(MIXED, None), (DECODE, 4)], ids=["prefill", "decode"])
def test_triton_paged_equals_host_plan(batch, max_q_len):
    pytest.importorskip("triton")
    from test_paged import paged_step

    layer = sa.LayerMask(window=7, spans="clamp")
    host, q, k, v, kc, vc, bt = paged_step(batch, layer, 4, 2, 16, 16, torch.float16, width=5)
    planner = planner_for(batch, {"l": layer}, max_q_len=max_q_len, max_kv_len=80)
    planner.prepare("triton", head_dim=16, dtype=torch.float16, group=2)
    plan = planner.update(*inputs(batch))["l"]
    pad = lambda t, n: torch.cat([t, t.new_zeros(n, *t.shape[1:])])
    qp, btp = (
        pad(q, planner.capacity.max_tokens - batch.total_q),
        pad(bt, planner.capacity.max_seqs - len(batch)),
    )
    want = sa.attention(q, kc, vc, host, block_table=bt, backend="triton", return_lse=True)
    got = sa.attention(qp, kc, vc, plan, block_table=btp, backend="triton", return_lse=True)
    assert torch.equal(got[0][: batch.total_q], want[0]) and torch.equal(got[1][: batch.total_q], want[1])
    with pytest.raises(
        ValueError, match="block_table has 4 blocks per sequence but the device plan's max_kv_len=80"
    ):
        sa.attention(qp, kc, vc, plan, block_table=btp[:, :4].contiguous(), backend="triton")


def test_slot_mapping_on_the_device():
    """The step's new keys go where the host plan's slot mapping puts them; padding rows and a
    rejected sequence's rows map to -1 (write_kv_cache skips them)."""
    from spanattn.cache import slot_mapping

    planner = planner_for(CLEAN, {"l": LAYER}, slack=4)
    q, kv, causal, spans = inputs(CLEAN)
    plan = planner.update(q, kv, causal, spans)["l"]
    width = -(-planner.capacity.max_kv_len // 8)
    bt = torch.randperm(planner.capacity.max_seqs * width, device=DEV).view(-1, width).to(torch.int32)
    want = slot_mapping(sa.plan(CLEAN, LAYER, DEV), bt[: len(CLEAN)], 8)
    got = plan.slot_mapping(bt, 8)
    assert torch.equal(got[: CLEAN.total_q], want) and (got[CLEAN.total_q :] == -1).all()
    spans = torch.cat([spans, spans.new_tensor([[1, 9, 3]])])  # sequence 1 rejected
    got = planner.update(q, kv, causal, spans)["l"].slot_mapping(bt, 8)
    rows = [*range(6), *range(9, 13)]
    assert torch.equal(got[rows], want[rows]) and (got[6:9] == -1).all()
    with pytest.raises(ValueError, match="block_table must be"):
        plan.slot_mapping(bt[:, :2], 8)
    with pytest.raises(TypeError, match="block_size must be an int, got 8.0"):
        plan.slot_mapping(bt, 8.0)
