"""The triton backend's backward kernels (backends/triton/gradients.py) against fp64 truth by
oracle.GradTruth's rule, under TRITON_INTERPRET=1 when there is no GPU: one fixed step per
feature, random layouts, every head_dim form (padded, split columns), the LSE's gradient;
isolation (a poisoned sequence changes no other sequence's gradients by a bit), determinism,
strided inputs, and every output row written. Interpreter shapes are small and tiles 16 x 16,
so short sequences still cross many tile edges."""

import math
import os

import torch

if not torch.cuda.is_available():  # before triton is imported anywhere (conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from strategies import batches, grouped_batches, layers  # noqa: E402
from triton_cpu import DEV, load  # noqa: E402

import spanattn as sa  # noqa: E402
from spanattn.isolation import bitwise_equal  # noqa: E402
from spanattn.oracle import GradTruth  # noqa: E402
from spanattn.scenarios import group_check_step  # noqa: E402

for name, kernel in (("kernel", "attn_fwd"), ("bwd_scores", "bwd_preprocess"), ("kernel_dq", "attn_bwd_dq"),
                     ("kernel_dkdv", "attn_bwd_dkdv")):  # fmt: skip
    load(f"backends.triton.{name}", kernel)
from spanattn.backends import triton as tb  # noqa: E402
from spanattn.backends.triton.configs import Config, pick_backward  # noqa: E402
from spanattn.backends.triton.gradients import backward  # noqa: E402


def inputs(plan, hq=2, hkv=1, d=32, dtype=torch.float16, dlse=False, seed=0):
    """q, k, v, dout and dlse (or None) of a step, on DEV."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(plan.total_q, hq, d, generator=g)
    k, v = (torch.randn(plan.total_k, hkv, d, generator=g) for _ in range(2))
    dout = torch.randn(plan.total_q, hq, d, generator=g)
    dl = torch.randn(plan.total_q, hq, generator=g) if dlse else None
    q, k, v, dout = (t.to(dtype).to(DEV) for t in (q, k, v, dout))
    return q, k, v, dout, None if dl is None else dl.to(DEV)


def grads(plan, q, k, v, dout, dlse=None, softcap=None, **kw):
    """The forward's out and LSE, then the backward's dq, dk, dv."""
    scale = q.shape[-1] ** -0.5
    out, lse = tb.forward(q, k, v, plan, scale=scale, softcap=softcap, return_lse=True, kernel="prefill")
    return backward(q, k, v, out, lse, dout, plan, scale=scale, softcap=softcap, dlse=dlse, **kw)


def check(batch, layer, hq=2, hkv=1, d=32, dtype=torch.float16, softcap=None, dlse=False, seed=0, **kw):
    """Gradients of one step held to the rule; returns them."""
    p = sa.plan(batch, layer, device=DEV)
    q, k, v, dout, dl = inputs(p, hq, hkv, d, dtype, dlse, seed)
    dq, dk, dv = grads(p, q, k, v, dout, dl, softcap, **kw)
    assert (dq.dtype, dq.shape, dk.shape, dv.shape) == (q.dtype, q.shape, k.shape, v.shape)
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    cpu = p if DEV == "cpu" else sa.plan(batch, layer)
    to_cpu = lambda t: None if t is None else t.cpu()
    truth = GradTruth(q.cpu(), k.cpu(), v.cpu(), cpu, dout.cpu(), to_cpu(dl), scale=d**-0.5, softcap=softcap)
    verdict = truth.check(dq.cpu(), dk.cpu(), dv.cpu(), rounding_slack=True)
    assert verdict.ok, str(verdict)
    return dq, dk, dv


GROUPED = sa.Batch(
    [
        sa.Seq(q_len=40, kv_len=60, spans=[(5, 12, 0), (30, 40, 0), (50, 55, 0)]),  # a group's image cached
        sa.Seq(q_len=1, kv_len=30, spans=[(3, 9, 0), (20, 29, 0)]),  # a decode row in a group
        sa.Seq(q_len=30, spans=[(0, 3, 0), (20, 29, 0), (10, 15)]),
    ]
)
CANVASES = sa.Batch([sa.Seq(q_len=35, causal=False), sa.Seq(q_len=20, kv_len=50, causal=False)])
FLAGS = sa.Batch([sa.Seq(q_len=33, causal=False), sa.Seq(q_len=18, spans=[(3, 9)])])
FEATURES = {
    "image wider than the window, clamp": (sa.Batch([sa.Seq(40, spans=[(5, 33)])]), sa.LayerMask(6, "clamp")),
    "non-causal canvases": (CANVASES, sa.LayerMask()),
    "inclusive window, causal and not": (FLAGS, sa.LayerMask(window=7, noncausal_window="inclusive")),
    "decode rows": (sa.Batch([sa.Seq(q_len=1, kv_len=n) for n in (1, 17, 40)]), sa.LayerMask(window=20)),
    "chunk": (sa.Batch([sa.Seq(q_len=20, kv_len=70, spans=[(40, 60)]), sa.Seq(q_len=3, kv_len=16)]),
              sa.LayerMask(window=24, spans="on")),
    "groups on": (GROUPED, sa.LayerMask(window=8, spans="on")),
    "groups clamp": (GROUPED, sa.LayerMask(window=8, spans="clamp")),
    "groups global": (GROUPED, sa.LayerMask()),
}  # fmt: skip


@pytest.mark.parametrize("name", FEATURES)
def test_feature(name):
    check(*FEATURES[name], hq=4, hkv=2)


@pytest.mark.parametrize("layer", list(group_check_step()[1]))
def test_group_check_step(layer):
    """The mixed step with span groups every backend is held to (scenarios.group_check_step)."""
    batch, layers_ = group_check_step()
    check(batch, layers_[layer], hq=2, hkv=1, d=16)


@pytest.mark.parametrize("hq, hkv", [(4, 1), (8, 2)], ids=["gqa4", "gqa4-two-kv-heads"])
def test_gqa(hq, hkv):
    check(*FEATURES["chunk"], hq=hq, hkv=hkv, d=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_softcap_and_lse_gradient(dtype):
    check(GROUPED, sa.LayerMask(window=8, spans="on"), softcap=2.0, dlse=True, dtype=dtype)


def test_lse_gradient_alone():
    """A loss on the LSE only: dout is zero, delta is -dlse."""
    p = sa.plan(*FEATURES["chunk"], device=DEV)
    q, k, v, dout, dl = inputs(p, dlse=True, dtype=torch.float32)
    dq, dk, dv = grads(p, q, k, v, torch.zeros_like(dout), dl)
    truth = GradTruth(
        q.cpu(), k.cpu(), v.cpu(), sa.plan(*FEATURES["chunk"]), torch.zeros_like(dout).cpu(), dl.cpu()
    )
    assert truth.check(dq.cpu(), dk.cpu(), dv.cpu()).ok and not dv.any()


@pytest.mark.parametrize("d, dtype", [(48, torch.float16), (96, torch.float32), (512, torch.float16)])
def test_head_dims(d, dtype):
    """Padded head_dims (48 -> 64, 96 -> 128) and the widest, on a tiny step."""
    batch = sa.Batch([sa.Seq(q_len=9, kv_len=20, spans=[(12, 16)]), sa.Seq(q_len=3)])
    check(batch, sa.LayerMask(window=6, spans="on"), hq=1, hkv=1, d=d, dtype=dtype)


@pytest.mark.parametrize(
    "dkdv, dq",
    [(Config(16, 16, 4, 1, dv_split=2), Config(16, 16, 4, 1, dv_split=2)),
     (Config(32, 16, 4, 1), Config(16, 32, 4, 1)), (Config(16, 32, 4, 1, dv_split=2), Config(32, 16, 4, 1))],
    ids=["split", "wide-query-tiles", "wide-key-tiles-split"],
)  # fmt: skip
def test_tile_shapes_and_column_splits(dkdv, dq):
    """Programs sharing a tile by output columns (d512's form), and query tiles wider than key
    tiles and the reverse, on a padded head_dim with span groups."""
    check(GROUPED, sa.LayerMask(window=8, spans="on"), hq=2, hkv=1, d=48, config=(dkdv, dq))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [16, 64, 128, 256, 512])
def test_gpu_tiles(d, dtype):
    """The tiles configs.pick_backward gives a GPU, run here: tiles up to 128 rows over
    sequences of 30-60, columns split at d512 (and fp32's dQ from d128)."""
    config = pick_backward(d, dtype, interpreted=False)
    check(GROUPED, sa.LayerMask(window=8, spans="clamp"), hq=2, hkv=1, d=d, dtype=dtype, config=config)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=batches(max_seqs=3, max_len=60),
    layer=layers(max_window=60),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 1)]),
    d=st.sampled_from([16, 32, 48, 64]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    softcap=st.sampled_from([None, 3.0]),
    dlse=st.booleans(),
)
def test_random_layouts(batch, layer, heads, d, dtype, softcap, dlse):
    check(batch, layer, *heads, d=d, dtype=dtype, softcap=softcap, dlse=dlse)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=grouped_batches(max_seqs=2, max_len=60),
    layer=layers(max_window=60),
    dtype=st.sampled_from([torch.float16, torch.float32]),
)
def test_random_span_groups(batch, layer, dtype):
    check(batch, layer, 2, 1, d=16, dtype=dtype)


ISOLATION_STEP = sa.Batch(
    [
        sa.Seq(q_len=20, kv_len=37, spans=[(10, 14, 0), (25, 30, 0)]),
        sa.Seq(q_len=1, kv_len=21),
        sa.Seq(q_len=19, causal=False, spans=[(2, 5, 1), (9, 12, 1)]),
        sa.Seq(q_len=13, kv_len=13, spans=[(3, 8)]),
    ]
)  # lengths no multiple of a tile: query and key tiles would straddle sequences


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the poisoned rows
def test_a_poisoned_sequence_changes_no_other_gradient_and_calls_repeat():
    """NaN, +-inf in one sequence's q, k, v, dout and dlse (the forward run on the poisoned
    inputs, as training would) leave every other sequence's dq, dk, dv bit for bit; the clean
    step is finite and the same bits call after call."""
    for layer in (sa.LayerMask(window=6, spans="clamp"), sa.LayerMask(spans="on")):
        p = sa.plan(ISOLATION_STEP, layer, device=DEV)
        q, k, v, dout, dl = inputs(p, hq=4, hkv=2, d=16, dlse=True)
        clean = grads(p, q, k, v, dout, dl)
        assert all(bool(torch.isfinite(t).all()) for t in clean)
        again = grads(p, q.clone(), k.clone(), v.clone(), dout.clone(), dl.clone())
        assert all(bitwise_equal(a, b) for a, b in zip(clean, again))
        cu_q, cu_k = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
        for victim, poison in ((2, math.nan), (0, math.inf), (3, -math.inf)):
            qr, kr = slice(cu_q[victim], cu_q[victim + 1]), slice(cu_k[victim], cu_k[victim + 1])
            bad = [t.clone() for t in (q, k, v, dout, dl)]
            for t, rows in zip(bad, (qr, kr, kr, qr, qr)):
                t[rows] = poison
            dirty = grads(p, *bad)
            for i in range(p.num_seqs):
                if i == victim:
                    continue
                rows = (slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1]))
                for name, a, b, r in zip(("dq", "dk", "dv"), clean, dirty, (rows[0], rows[1], rows[1])):
                    assert bitwise_equal(a[r], b[r]), f"{poison} in sequence {victim}: sequence {i}'s {name}"


def test_strided_inputs_give_the_contiguous_bits():
    """Transposed views (head-major storage, as transformers passes them), a non-contiguous
    output and a gradient expanded from a sum (zero strides) read as their contiguous copies."""
    p = sa.plan(*FEATURES["groups on"], device=DEV)
    q, k, v, dout, _ = inputs(p, hq=4, hkv=2, d=16)
    head_major = lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)
    ones = torch.ones(1, 1, 1, dtype=q.dtype, device=DEV).expand_as(q)
    scale = 0.25
    out, lse = tb.forward(q, k, v, p, scale=scale, return_lse=True, kernel="prefill")
    want = backward(q, k, v, out, lse, ones.contiguous(), p, scale=scale)
    views = (head_major(t) for t in (q, k, v, out))
    got = backward(*views, lse.t().contiguous().t(), ones, p, scale=scale)
    assert all(bitwise_equal(a, b) for a, b in zip(want, got))


def test_every_row_is_written(monkeypatch):
    """Outputs allocated full of NaN: keys no query sees (a cached key behind every window) get
    zero gradients, every other row its own."""
    p = sa.plan(sa.Batch([sa.Seq(q_len=5, kv_len=40), sa.Seq(q_len=17)]), sa.LayerMask(window=3), device=DEV)
    q, k, v, dout, _ = inputs(p, d=16)
    out, lse = tb.forward(q, k, v, p, scale=0.25, return_lse=True, kernel="prefill")
    new_empty = torch.Tensor.new_empty

    def poisoned(t, *args, **kw):
        out = new_empty(t, *args, **kw)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    dq, dk, dv = backward(q, k, v, out, lse, dout, p, scale=0.25)
    assert all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
    assert not dk[:32].any() and not dv[:32].any() and dk[33:40].any()  # keys 0..32 behind every window


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# Steps without span groups (the Gluon kernels walk none), lengths no multiple of their tiles
# (dK/dV: 32 queries, 64-128 keys; dQ: 128 queries, 32-64 keys): tiles straddle sequences,
# chunks end mid-tile, a chunk is shorter than a query tile. The last two have a sequence shorter
# than a dQ key tile: dQ runs on kernel_dq.py there (gluon_backward.dq_fits), dK/dV on Gluon.
GLUON_STEPS = {
    "causal varlen": (sa.Batch([sa.Seq(300), sa.Seq(71), sa.Seq(129), sa.Seq(q_len=5, kv_len=64)]),
                      sa.LayerMask()),
    "window, image wider, clamp": (
        sa.Batch([sa.Seq(400, spans=[(50, 300)]), sa.Seq(q_len=90, kv_len=333, spans=[(10, 40)])]),
        sa.LayerMask(window=100, spans="clamp"),
    ),
    "chunk and canvas": (
        sa.Batch([sa.Seq(q_len=200, kv_len=520, spans=[(250, 480)]), sa.Seq(130, causal=False)]),
        sa.LayerMask(spans="on"),
    ),
    "short": (sa.Batch([sa.Seq(300), sa.Seq(17), sa.Seq(129), sa.Seq(64)]), sa.LayerMask()),
    "decode rows": (sa.Batch([sa.Seq(q_len=1, kv_len=n) for n in (1, 40, 200)] + [sa.Seq(5)]),
                    sa.LayerMask(window=64)),
}  # fmt: skip


def _gluon_calls(monkeypatch) -> dict:
    """Calls of the Gluon backward kernels from here on, by kernel."""
    from spanattn.backends.triton import gluon_backward

    calls = {"dkdv": 0, "dq": 0}

    def counted(name, real):
        def run(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)

        return run

    for name in calls:
        monkeypatch.setattr(gluon_backward, name, counted(name, getattr(gluon_backward, name)))
    return calls


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on Hopper")
@pytest.mark.parametrize("name", GLUON_STEPS)
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
@pytest.mark.parametrize(("dtype", "softcap"), [(torch.bfloat16, None), (torch.float16, 20.0)])
@pytest.mark.parametrize("d", [128, 256, 512])
def test_gluon_backward(name, heads, dtype, softcap, d, monkeypatch):
    """The Gluon kernels' dq, dk, dv held to the rule, close to the portable kernels' (the
    summation order differs), the same bits call after call; the backend routes a Hopper step
    to them when asked."""
    calls = _gluon_calls(monkeypatch)
    batch, layer = GLUON_STEPS[name]
    fits = min(s.kv_len for s in batch.seqs) >= {128: 64, 256: 32, 512: 16}[d]
    got = check(batch, layer, *heads, d=d, dtype=dtype, softcap=softcap, gluon=True)
    assert calls == {"dkdv": 1, "dq": int(fits)}, calls
    p = sa.plan(batch, layer, device=DEV)
    q, k, v, dout, _ = inputs(p, *heads, d=d, dtype=dtype)
    portable = grads(p, q, k, v, dout, softcap=softcap, gluon=False)
    again = grads(p, q, k, v, dout, softcap=softcap, gluon=True)
    assert all(bitwise_equal(a, b) for a, b in zip(got, again))
    for a, b in zip(got, portable):
        assert float((a.float() - b.float()).abs().max()) <= 2e-2 * float(b.float().abs().max())
    monkeypatch.setenv(tb.GLUON_ENV, "1")  # asked for (gluon_backward_runs)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = sa.attention(qg, kg, vg, p, backend="triton", softcap=softcap)
    auto = torch.autograd.grad(out, (qg, kg, vg), dout)
    assert calls == {"dkdv": 3, "dq": 3 * int(fits)} and all(bool(torch.isfinite(t).all()) for t in auto)


@pytest.mark.skipif(not HOPPER, reason="the Gluon backward runs on Hopper")
@pytest.mark.parametrize("d", [128, 256, 512])
def test_gluon_backward_isolation_and_every_row(d, monkeypatch):
    """NaN or inf in one sequence's q, k, v, dout leaves the others' gradients bit for bit (a
    dK/dV query tile past a chunk's end holds the next sequence's rows: zeroed before use; dQ's
    last key tile is read shifted back); outputs allocated full of NaN get every row written,
    zero where no query sees a key; and head-major views (transformers' storage) give the
    contiguous bits."""
    calls = _gluon_calls(monkeypatch)
    batch = sa.Batch([sa.Seq(q_len=45, kv_len=170), sa.Seq(q_len=1, kv_len=71), sa.Seq(77, causal=False),
                      sa.Seq(133, spans=[(3, 20)])])  # fmt: skip
    p = sa.plan(batch, sa.LayerMask(window=40, spans="clamp"), device=DEV)
    q, k, v, dout, _ = inputs(p, 4, 2, d=d, dtype=torch.bfloat16)
    clean = grads(p, q, k, v, dout, gluon=True)
    cu_q, cu_k = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
    for victim, poison in ((2, math.nan), (0, math.inf), (3, -math.inf)):
        qr, kr = slice(cu_q[victim], cu_q[victim + 1]), slice(cu_k[victim], cu_k[victim + 1])
        bad = [t.clone() for t in (q, k, v, dout)]
        for t, rows in zip(bad, (qr, kr, kr, qr)):
            t[rows] = poison
        dirty = grads(p, *bad, gluon=True)
        for i in (i for i in range(p.num_seqs) if i != victim):
            qr, kr = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            for name, a, b, r in zip(("dq", "dk", "dv"), clean, dirty, (qr, kr, kr)):
                assert bitwise_equal(a[r], b[r]), f"{poison} in sequence {victim}: sequence {i}'s {name}"
    scale = d**-0.5
    out, lse = tb.forward(q, k, v, p, scale=scale, return_lse=True, kernel="prefill")
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(math.nan)
                        if kw.get("dtype", torch.float32).is_floating_point else empty(*a, **kw))  # fmt: skip
    poisoned = backward(q, k, v, out, lse, dout, p, scale=scale, gluon=True)
    monkeypatch.setattr(torch, "empty", empty)
    assert all(bitwise_equal(a, b) for a, b in zip(clean, poisoned))
    assert float(clean[1][: 170 - 45 - 40].abs().max()) == 0.0  # cached keys behind the window
    head_major = lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)
    q_h, k_h, v_h, out_h, dout_h = (head_major(t) for t in (q, k, v, out, dout))
    views = backward(q_h, k_h, v_h, out_h, lse, dout_h, p, scale=scale, gluon=True)
    assert all(bitwise_equal(a, b) for a, b in zip(clean, views))
    assert calls == {"dkdv": 6, "dq": 6}, calls
