"""The triton prefill kernel against fp64 truth (docs/design.md section 4), under TRITON_INTERPRET=1
when there is no GPU. Outputs are poisoned with NaN first, so an unwritten row fails. The
interpreter is slow: shapes are small and tiles are 16 x 16 (configs.INTERPRETER_CONFIG), so
short sequences still cross many tile edges."""

import importlib
import os

import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from strategies import batches, layers  # noqa: E402
from tolerance import assert_close_to_truth  # noqa: E402

import spanattn as sa  # noqa: E402

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernel module as this run needs it: if something imported it before the interpreter
    was switched on (doctest collection), decorate it again."""
    from spanattn.backends.triton import kernel

    if DEV == "cpu" and not kernel.INTERPRETED:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_INTERPRET is not set and there is no GPU")
        importlib.reload(kernel)
    return kernel


def run(batch, layer, hq=2, hkv=1, d=32, dtype=torch.float16, softcap=None, seed=0, **kw):
    from spanattn.backends import triton as tb

    g = torch.Generator().manual_seed(seed)
    p = sa.plan(batch, layer, device=DEV)
    q = torch.randn(p.total_q, hq, d, generator=g).to(dtype).to(DEV)
    k = torch.randn(p.total_k, hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(p.total_k, hkv, d, generator=g).to(dtype).to(DEV)
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(
        q, k, v, p, scale=d**-0.5, softcap=softcap, return_lse=True, out=out, kernel="prefill", **kw
    )
    opts = {"softcap": softcap} if softcap else {}
    cpu = p if DEV == "cpu" else sa.plan(batch, layer)
    assert_close_to_truth(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), cpu, scale=d**-0.5, **opts)
    return out, lse


MIXED = sa.Batch(
    [
        sa.Seq(q_len=40, kv_len=75, spans=[(16, 31), (48, 70)]),  # spans on 16-tile edges, chunked
        sa.Seq(q_len=1, kv_len=23),  # a decode row
        sa.Seq(q_len=19, kv_len=19, causal=False),  # a canvas
        sa.Seq(q_len=1, kv_len=1),
    ]
)


@pytest.mark.parametrize(
    "layer",
    [
        sa.LayerMask(spans="off"),
        sa.LayerMask(spans="on"),
        sa.LayerMask(window=1),
        sa.LayerMask(window=20, spans="clamp"),
        sa.LayerMask(window=9, spans="on", noncausal_window="inclusive"),
    ],
    ids=["causal", "on", "W1", "W20-clamp", "W9-on-inclusive"],
)
def test_mixed_batch_layers(layer):
    run(MIXED, layer, hq=4, hkv=2)


@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2), (4, 1)])
def test_gqa(hq, hkv):
    run(sa.Batch([sa.Seq(q_len=17, kv_len=33, spans=[(20, 31)])]), sa.LayerMask(window=8), hq, hkv, d=16)


@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.float32), (96, torch.float16)])
def test_head_dims(d, dtype):
    run(sa.Batch([sa.Seq(q_len=18, kv_len=35, spans=[(15, 32)]), sa.Seq(q_len=1, kv_len=9)]),
        sa.LayerMask(spans="on"), 2, 1, d=d, dtype=dtype)  # fmt: skip


def test_single_token():
    run(sa.Batch([sa.Seq(q_len=1)]), sa.LayerMask(), hq=1, hkv=1, d=16, dtype=torch.float32)


def test_softcap():
    run(MIXED, sa.LayerMask(window=20, spans="on"), softcap=2.0)


def test_lse_and_out_for_one_key():
    """W=1: every causal row sees only itself, so out is that key's v and lse its scaled score.
    Within an ulp or two, not bit for bit: the scale is folded into exp2's argument (one fused
    multiply-add on the GPU), so the row's one weight is 2**e with e a rounding error, not 1."""
    from spanattn.backends import triton as tb

    p = sa.plan(sa.Batch([sa.Seq(q_len=33)]), sa.LayerMask(window=1), device=DEV)
    q, k, v = (torch.randn(33, 1, 16, device=DEV) for _ in range(3))
    out, lse = tb.forward(q, k, v, p, scale=0.5, return_lse=True, kernel="prefill")
    torch.testing.assert_close(out, v, rtol=4e-7, atol=0)
    torch.testing.assert_close(lse, (q * k).sum(-1) * 0.5, atol=1e-5, rtol=1e-5)


def test_paged_equals_packed():
    """Paged K/V in shuffled pages gives bit-for-bit the packed result (same tiles, same order)."""
    from spanattn.backends import triton as tb

    batch = sa.Batch([sa.Seq(q_len=20, kv_len=45, spans=[(30, 44)]), sa.Seq(q_len=3, kv_len=8, causal=False)])
    p = sa.plan(batch, sa.LayerMask(window=12, spans="clamp"), device=DEV)
    g = torch.Generator().manual_seed(1)
    hkv, d, page = 1, 16, 8
    q = torch.randn(p.total_q, 2, d, generator=g).to(DEV)
    k = torch.randn(p.total_k, hkv, d, generator=g).to(DEV)
    v = torch.randn(p.total_k, hkv, d, generator=g).to(DEV)
    need = [-(-s.kv_len // page) for s in batch.seqs]
    pages = torch.randperm(sum(need) + 2, generator=g)
    kc = torch.full((len(pages), page, hkv, d), float("nan"), device=DEV)
    vc = torch.full_like(kc, float("nan"))
    bt = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    used, cu_k = 0, p.cu_seqlens_k.tolist()
    for i, s in enumerate(batch.seqs):
        bt[i, : need[i]] = pages[used : used + need[i]]
        bt[i, need[i] :] = pages[-1]  # never read: NaN would show
        for pos in range(s.kv_len):
            kc[bt[i, pos // page], pos % page] = k[cu_k[i] + pos]
            vc[bt[i, pos // page], pos % page] = v[cu_k[i] + pos]
        used += need[i]
    packed = tb.forward(q, k, v, p, scale=0.25, return_lse=True, kernel="prefill")
    paged = tb.forward(q, kc, vc, p, scale=0.25, return_lse=True, kernel="prefill", block_table=bt.to(DEV))
    assert torch.equal(packed[0], paged[0]) and torch.equal(packed[1], paged[1])


def test_through_attention_api():
    """backend="triton" by name, with a prefill-shaped step."""
    p = sa.plan(sa.Batch([sa.Seq(q_len=20, kv_len=30, spans=[(12, 25)])]), sa.LayerMask(window=5), device=DEV)
    q, k, v = (
        torch.randn(20, 2, 16, device=DEV),
        torch.randn(30, 1, 16, device=DEV),
        torch.randn(30, 1, 16, device=DEV),
    )
    out = sa.attention(q, k, v, p, backend="triton")
    want = sa.attention(q, k, v, p, backend="reference")
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_unsupported_head_dim_says_why():
    from spanattn.backends import triton as tb

    p = sa.plan(sa.Batch([sa.Seq(q_len=2)]), sa.LayerMask(), device=DEV)
    for d in (24, 528):
        assert "head_dim" in tb.unavailable(torch.zeros(2, 1, d, device=DEV), p)
    with pytest.raises(RuntimeError, match="head_dim"):
        sa.attention(*(torch.zeros(2, 1, 24, device=DEV),) * 3, p, backend="triton")


def test_schedule_covers_every_query_once_heaviest_first():
    from spanattn.backends.triton.columns import INFO
    from spanattn.backends.triton.schedule import build_schedule
    from spanattn.backends.triton.schedule_triton import tile_schedule

    batch = sa.Batch(
        [sa.Seq(q_len=40, kv_len=100), sa.Seq(q_len=1, kv_len=7), sa.Seq(q_len=33, causal=False)]
    )
    p = sa.plan(batch, sa.LayerMask(spans="off"))
    s = build_schedule(p, 16, 16)
    starts = sorted(zip(s.column("seq").tolist(), s.column("q_row0").tolist()))
    assert starts == [(0, 0), (0, 16), (0, 32), (1, 40), (2, 41), (2, 57), (2, 73)]
    cost = s.tile_cost.tolist()
    assert cost == sorted(cost, reverse=True)
    row = dict(zip(INFO, s.info[0].tolist()))
    # tile (0, 32): queries 32..39 at positions 92..99, causal from 0; FULL key tiles end at 80
    assert cost[0] == 100 and row == {
        "q_row0": 32, "q_row_last": 39, "k_row0": 0, "kv_len": 100, "seq": 0,
        "kv_start": 0, "kv_end": 100, "full_start": 0, "full_end": 80,
    }  # fmt: skip
    last = dict(zip(INFO, s.info[s.column("q_row0") == 73][0].tolist()))
    assert last == {
        "q_row0": 73, "q_row_last": 73, "k_row0": 107, "kv_len": 33, "seq": 2,
        "kv_start": 0, "kv_end": 33, "full_start": 0, "full_end": 32,
    }  # fmt: skip
    key_tiles = s.key_tiles()  # ceil((kv_end - kv_start) / 16): 100 and 33 keys
    assert key_tiles[0] == 7 and key_tiles[s.column("q_row0") == 73].tolist() == [3]
    assert tile_schedule(p, 16, 16) is tile_schedule(p, 16, 16)  # built once per plan, reused by layers


def assert_same_schedule(batch, layer):
    from spanattn.backends.triton.schedule import build_schedule
    from spanattn.backends.triton.schedule_triton import build_schedule_triton

    p = sa.plan(batch, layer, device=DEV)
    for block_m, block_n in ((16, 16), (16, 32), (32, 16)):
        a, b = build_schedule(p, block_m, block_n), build_schedule_triton(p, block_m, block_n)
        assert torch.equal(a.info, b.info) and torch.equal(a.tile_cost, b.tile_cost)


@settings(max_examples=8, deadline=None)
@given(batch=batches(max_seqs=4, max_len=90), layer=layers(max_window=60))
def test_one_launch_schedule_equals_the_definition(batch, layer):
    assert_same_schedule(batch, layer)


def test_one_launch_schedule_on_tile_edges():
    """Interval ends one short of a tile edge, where a rounding slip shows."""
    edges = sa.Batch([sa.Seq(q_len=17, kv_len=32), sa.Seq(q_len=20, kv_len=32, causal=False), *MIXED.seqs])
    for layer in (sa.LayerMask(spans="off"), sa.LayerMask(window=16, spans="on")):
        assert_same_schedule(edges, layer)
        assert_same_schedule(LONG_ENOUGH, layer)


@settings(max_examples=8, deadline=None)
@given(batch=batches(max_seqs=4, max_len=90), layer=layers(max_window=60))
def test_schedule_key_walks_hold_every_row(batch, layer):
    """Each tile walks keys ``[kv_start, kv_end)`` holding all its rows' intervals, from a
    multiple of block_n; its FULL range (multiples of block_n, or empty) lies inside every row's
    interval."""
    from spanattn.backends.triton.columns import INFO
    from spanattn.backends.triton.schedule import build_schedule

    p = sa.plan(batch, layer)
    lo, hi = p.lo.tolist(), p.hi.tolist()
    for info in build_schedule(p, 16, 32).info.tolist():
        t = dict(zip(INFO, info))
        rows = range(t["q_row0"], t["q_row_last"] + 1)
        assert t["kv_start"] % 32 == 0
        # an empty FULL range may sit at kv_end, which need not be a multiple
        assert all(t[c] % 32 == 0 or t[c] == t["kv_end"] for c in ("full_start", "full_end"))
        assert t["kv_start"] <= min(lo[r] for r in rows) and t["kv_end"] == max(hi[r] for r in rows) + 1
        assert t["kv_end"] <= t["kv_len"] and len(rows) <= 16
        if t["full_start"] < t["full_end"]:
            assert all(lo[r] <= t["full_start"] and t["full_end"] <= hi[r] + 1 for r in rows)
        assert t["kv_start"] > min(lo[r] for r in rows) - 32


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_seqs=3, max_len=80), layer=layers(max_window=80))
def test_random_layouts(batch, layer):
    run(batch, layer, hq=2, hkv=1, d=16)


def test_configs_without_tma_keep_their_tiles():
    """Paged walks cannot use TMA: they keep the layer kind's tiles and loop shape (d128 global:
    8 warps x 128 x 128, three loops) and only drop the TMA flag."""
    from spanattn.backends.triton.configs import Config, pick

    bf16 = torch.bfloat16
    assert pick(128, bf16, False).tma and not pick(128, bf16, False).one_loop
    assert pick(128, bf16, False, tma=False) == Config(128, 128, 8, 3)
    assert pick(128, bf16, False, 1024, tma=False) == Config(128, 128, 8, 3, one_loop=True)
    assert pick(256, bf16, False, tma=False) == Config(128, 64, 8, 2, one_loop=True)
    assert pick(64, bf16, True, tma=True).tma is False  # the interpreter's tiles


# Every sequence at least one 32-key tile long, none a multiple of it: TMA runs (uses_tma) and
# reads the tile across each sequence end shifted back.
LONG_ENOUGH = sa.Batch(
    [
        sa.Seq(q_len=40, kv_len=75, spans=[(16, 31), (48, 70)]),
        sa.Seq(q_len=1, kv_len=33),
        sa.Seq(q_len=37, kv_len=37, causal=False),
        sa.Seq(q_len=5, kv_len=64),
    ]
)


@pytest.mark.parametrize(
    "one_loop, dv_split, d, tma, batch",
    [(False, 1, 32, False, MIXED), (True, 1, 32, False, MIXED), (False, 2, 32, False, MIXED),
     (True, 2, 48, False, MIXED), (False, 1, 32, True, LONG_ENOUGH), (True, 1, 32, True, LONG_ENOUGH),
     (True, 2, 32, True, LONG_ENOUGH)],
    ids=["three-loops", "one-loop", "dv-split", "one-loop-dv-split-padded", "tma", "tma-one-loop",
         "tma-dv-split"],
)  # fmt: skip
def test_loop_variants_and_tile_shapes(one_loop, dv_split, d, tma, batch):
    """Both KV-walk variants, split output columns and TMA loads, with key tiles wider than
    query tiles."""
    from spanattn.backends.triton import uses_tma
    from spanattn.backends.triton.configs import Config

    cfg = Config(16, 32, 4, 1, one_loop=one_loop, dv_split=dv_split, tma=tma)
    p = sa.plan(batch, sa.LayerMask(window=13, spans="on"), device=DEV)
    kv = torch.empty(p.total_k, 2, d, dtype=torch.float16, device=DEV)
    assert uses_tma(p, kv, kv, cfg) == tma
    run(batch, sa.LayerMask(window=13, spans="on"), hq=4, hkv=2, d=d, config=cfg)


def test_tma_only_where_tiles_fit_sequences():
    """Pointer loads for a sequence shorter than a key tile, a padded head_dim, heads not side
    by side in a row, or a config without TMA."""
    from spanattn.backends.triton import uses_tma
    from spanattn.backends.triton.configs import Config

    cfg = Config(16, 32, 4, 1, tma=True)
    p = sa.plan(LONG_ENOUGH, sa.LayerMask(), device=DEV)
    kv = torch.empty(p.total_k, 2, 32, dtype=torch.float16, device=DEV)
    assert uses_tma(p, kv, kv, cfg)
    assert not uses_tma(p, kv, kv, Config(16, 32, 4, 1))
    assert not uses_tma(sa.plan(MIXED, sa.LayerMask(), device=DEV), kv, kv, cfg)  # kv_len 1
    kv48 = torch.empty(p.total_k, 2, 48, dtype=torch.float16, device=DEV)
    assert not uses_tma(p, kv48, kv48, cfg)
    heads_apart = torch.empty(p.total_k, 4, 32, dtype=torch.float16, device=DEV)[:, ::2]
    assert not uses_tma(p, heads_apart, heads_apart, cfg)


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_sequences_never_read_each_others_keys(tma):
    """A key tile must not read a neighbour sequence's K/V: p = 0 there, but 0 * inf is NaN.
    The middle sequence's neighbours hold inf keys and NaN values; its output and LSE must still
    be exact (TMA: its last tile is read shifted back, its repeated keys masked)."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import Config

    seqs = [sa.Seq(q_len=5, kv_len=40), sa.Seq(q_len=21, kv_len=45), sa.Seq(q_len=5, kv_len=40)]
    p = sa.plan(sa.Batch(seqs), sa.LayerMask(spans="off"), device=DEV)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 32, generator=g) for n in (p.total_q, p.total_k, p.total_k))
    for rows in (slice(0, 40), slice(85, None)):
        k[rows], v[rows] = float("inf"), float("nan")
    q, k, v = (t.half().to(DEV) for t in (q, k, v))
    cfg = Config(16, 32, 4, 1, one_loop=True, tma=tma)
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=32**-0.5, return_lse=True, out=out, config=cfg)
    middle = sa.plan(sa.Batch(seqs[1:2]), sa.LayerMask(spans="off"))
    qc, kc, vc = (t[rows].cpu() for t, rows in ((q, slice(5, 26)), (k, slice(40, 85)), (v, slice(40, 85))))
    assert_close_to_truth(out[5:26].cpu(), lse[5:26].cpu(), qc, kc, vc, middle, scale=32**-0.5)
