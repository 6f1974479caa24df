"""The triton backend's Gluon kernels (kernel_gluon.py at head_dim 128/256, kernel_gluon_split.py
at 512: sm_90 only, no interpreter) against fp64 truth with NaN-poisoned outputs; elsewhere,
only that they are never chosen, and that asking for one is an error."""

from dataclasses import replace

import pytest
import torch
from tolerance import assert_close_to_truth

import spanattn as sa
from spanattn.scenarios import group_check_step

pytest.importorskip("triton")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not SM90, reason="the Gluon kernels run on sm_90 only")
DIMS = [128, 256, 512]

# Every sequence at least one 128-key tile long (the kernel reads K/V by TMA): a chunk with
# spans on and across tile edges, a decode row, a non-causal canvas, a ragged causal sequence.
LONG = sa.Batch(
    [
        sa.Seq(q_len=300, kv_len=700, spans=[(128, 255), (500, 640)]),
        sa.Seq(q_len=1, kv_len=333),
        sa.Seq(q_len=200, kv_len=200, causal=False),
        sa.Seq(q_len=130, kv_len=130, spans=[(3, 70)]),
    ]
)
LAYERS = {
    "causal": sa.LayerMask(spans="off"),
    "on": sa.LayerMask(spans="on"),
    "W1": sa.LayerMask(window=1),
    "W37-clamp": sa.LayerMask(window=37, spans="clamp"),
    "W200-on-inclusive": sa.LayerMask(window=200, spans="on", noncausal_window="inclusive"),
}

# Span groups: group_check_step's frames, chunk, decode row and canvas at positions x16 (every
# sequence at least 192 keys); its layers: global, a clamped window and a window narrower than
# a frame with spans on (pre walks).
_batch, GROUP_LAYERS = group_check_step(16)
GROUPED = sa.Batch(_batch.seqs[:4])


def test_chosen_only_for_hopper_tma_steps(monkeypatch):
    from spanattn.backends.triton import uses_gluon
    from spanattn.backends.triton.configs import pick_gluon

    cfg = pick_gluon(128, torch.bfloat16)
    assert pick_gluon(128, torch.float32) is None and pick_gluon(64, torch.bfloat16) is None
    p = sa.plan(LONG, sa.LayerMask(), device="cuda" if SM90 else "cpu")
    q, k, v = _qkv(p, 2, 1, torch.bfloat16)
    assert not uses_gluon(q, k, v, p, cfg)  # not on a GPU
    if SM90:
        q, k, v = q.cuda(), k.cuda(), v.cuda()
        assert uses_gluon(q, k, v, p, cfg)
        assert not uses_gluon(q, k, v, p, replace(cfg, gluon=False))
        assert not uses_gluon(q, k, v, p, replace(cfg, tma=False))
        assert not uses_gluon(q.float(), k, v, p, cfg)
        assert not uses_gluon(q, k, v, p, replace(cfg, block_m=64))  # no d128 kernel on 64 rows
        short = sa.plan(sa.Batch([sa.Seq(q_len=5, kv_len=100)]), sa.LayerMask(), device="cuda")
        assert not uses_gluon(q[:5], k[:100], v[:100], short, cfg)  # shorter than a key tile
        for d in (256, 512):
            qd, kd, vd = (t.repeat(1, 1, d // 128) for t in (q, k, v))
            assert uses_gluon(qd, kd, vd, p, pick_gluon(d, torch.bfloat16))
        heads_apart = q.repeat(1, 2, 1)[:, ::2]
        assert not uses_gluon(heads_apart, k, v, p, cfg)
        monkeypatch.setenv("SPANATTN_TRITON_GLUON", "0")
        assert not uses_gluon(q, k, v, p, cfg)


def test_a_gluon_config_where_it_cannot_run_is_an_error():
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon

    p = sa.plan(LONG, sa.LayerMask(), device="cuda" if SM90 else "cpu")
    q, k, v = (t.to(p.device) for t in _qkv(p, 2, 1, torch.float16))
    if tb.unavailable(q, p) is not None:
        pytest.skip(tb.unavailable(q, p))
    with pytest.raises(ValueError, match="Gluon kernel, which cannot run here"):
        tb.forward(q.float(), k.float(), v.float(), p, scale=0.1, config=pick_gluon(128, torch.float16))


def _qkv(p, hq, hkv, dtype, seed=0, d=128):
    g = torch.Generator().manual_seed(seed)
    shapes = ((p.total_q, hq), (p.total_k, hkv), (p.total_k, hkv))
    return (torch.randn(n, h, d, generator=g).to(dtype) for n, h in shapes)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("layer", list(LAYERS.values()), ids=list(LAYERS))
@pytest.mark.parametrize(
    "dtype, hq, hkv, softcap",
    [(torch.bfloat16, 8, 4, None), (torch.float16, 16, 2, None), (torch.bfloat16, 8, 8, 30.0)],
    ids=["bf16-gqa2", "fp16-gqa8", "bf16-mha-softcap"],
)
def test_matches_truth(layer, dtype, hq, hkv, softcap, d):
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon

    p = sa.plan(LONG, layer, device="cuda")
    q, k, v = (t.cuda() for t in _qkv(p, hq, hkv, dtype, d=d))
    assert tb.uses_gluon(q, k, v, p, pick_gluon(d, dtype))
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, softcap=softcap, return_lse=True, out=out)
    opts = {"softcap": softcap} if softcap else {}
    truth_plan = sa.plan(LONG, layer)
    assert_close_to_truth(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), truth_plan, scale=d**-0.5, **opts)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("layer", ["causal", "on"])
def test_maxima_that_keep_moving_late_in_a_walk(layer, d):
    """Keys whose norms grow along the sequence: rows' maxima pass their reference by more than
    2^8 (gluon_rescale's threshold) again and again, also past a walk's first tiles, where d256
    and d512 rescale only when a warp's maxima moved."""
    from spanattn.backends import triton as tb

    batch = sa.Batch([sa.Seq(q_len=1500, kv_len=2000, spans=[(700, 900)]), sa.Seq(q_len=300, kv_len=300)])
    p = sa.plan(batch, LAYERS[layer], device="cuda")
    q, k, v = _qkv(p, 4, 2, torch.float32, seed=5, d=d)
    k *= 1 + torch.arange(p.total_k).remainder(2000)[:, None, None] / 16
    q, k, v = (t.to(torch.bfloat16).cuda() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, return_lse=True, out=out)
    truth_plan = sa.plan(batch, LAYERS[layer])
    assert_close_to_truth(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), truth_plan, scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
def test_sequences_never_read_each_others_keys(d):
    """The middle sequence's neighbours hold inf keys and NaN values; its output and LSE must be
    exact (its last tile is read shifted back, never into the next sequence)."""
    from spanattn.backends import triton as tb

    seqs = [sa.Seq(q_len=5, kv_len=200), sa.Seq(q_len=150, kv_len=300), sa.Seq(q_len=5, kv_len=200)]
    p = sa.plan(sa.Batch(seqs), sa.LayerMask(spans="off"), device="cuda")
    q, k, v = _qkv(p, 4, 2, torch.float32, seed=3, d=d)
    for rows in (slice(0, 200), slice(500, None)):
        k[rows], v[rows] = float("inf"), float("nan")
    q, k, v = (t.half().cuda() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, return_lse=True, out=out)
    middle = sa.plan(sa.Batch(seqs[1:2]), sa.LayerMask(spans="off"))
    qc, kc, vc = (t[r].cpu() for t, r in ((q, slice(5, 155)), (k, slice(200, 500)), (v, slice(200, 500))))
    assert_close_to_truth(out[5:155].cpu(), lse[5:155].cpu(), qc, kc, vc, middle, scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
def test_head_major_kv_and_fused_qkv_rows(d):
    """K/V as transformers' cache holds them (each head's tokens one after another, inside a
    longer buffer) and q as rows of a fused QKV projection: TMA reads them in place."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon

    layer = LAYERS["on"]
    p = sa.plan(LONG, layer, device="cuda")
    q0, k0, v0 = _qkv(p, 8, 2, torch.bfloat16, seed=5, d=d)
    qkv = torch.full((p.total_q, 12 * d), float("nan"), dtype=torch.bfloat16, device="cuda")
    qkv[:, : 8 * d] = q0.flatten(1).cuda()
    q = qkv[:, : 8 * d].view(-1, 8, d)

    def head_major(x):
        buf = torch.full((x.shape[1], x.shape[0] + 40, d), float("nan"), dtype=x.dtype, device="cuda")
        buf[:, : x.shape[0]] = x.transpose(0, 1).cuda()
        return buf[:, : x.shape[0]].transpose(0, 1)

    k, v = head_major(k0), head_major(v0)
    assert tb.uses_gluon(q, k, v, p, pick_gluon(d, torch.bfloat16))
    out = torch.full_like(q0, float("nan")).cuda()
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, return_lse=True, out=out)
    assert_close_to_truth(out.cpu(), lse.cpu(), q0, k0, v0, sa.plan(LONG, layer), scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("layer", [LAYERS["on"], LAYERS["W37-clamp"]], ids=["on", "W37-clamp"])
def test_reads_a_paged_cache_in_place(d, page, layer):
    """Pages scattered at random, NaN in every slot no sequence owns (also past each sequence's
    end inside its last page, which the last key tile reads and must zero before P @ V)."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon
    from spanattn.cache import slot_mapping

    p = sa.plan(LONG, layer, device="cuda")
    q, k, v = _qkv(p, 8, 2, torch.bfloat16, seed=7, d=d)
    g = torch.Generator().manual_seed(1)
    need = [-(-s.kv_len // page) for s in LONG.seqs]
    ids = torch.randperm(sum(need) + 2, generator=g)
    bt = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    for i, n in enumerate(need):
        bt[i, :n] = ids[sum(need[:i]) : sum(need[: i + 1])]
    bt = bt.cuda()
    kc = torch.full((len(ids), page, 2, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    keys = sa.plan(sa.Batch([sa.Seq(q_len=s.kv_len) for s in LONG.seqs]), sa.LayerMask(), device="cuda")
    sa.write_kv_cache(k.cuda(), v.cuda(), kc, vc, slot_mapping(keys, bt, page))
    kf, vf, qc = kc.flatten(0, 1), vc.flatten(0, 1), q.cuda()
    assert tb.gluon_reads_pages(qc, kf, vf, p, pick_gluon(d, torch.bfloat16), page)
    out = torch.full_like(qc, float("nan"))
    out, lse = tb.forward(qc, kc, vc, p, scale=d**-0.5, return_lse=True, out=out, block_table=bt)
    assert_close_to_truth(out.cpu(), lse.cpu(), q, k, v, sa.plan(LONG, layer), scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("layer", list(GROUP_LAYERS))
def test_span_groups(d, page, layer):
    """Frames that see each other across text, a chunk whose group continues in the cache, two
    groups in one sequence, a canvas: packed K/V and a paged cache holding NaN where no sequence
    owns a slot (group_walk.py's pre and post walks read tiles at a sequence's end too)."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon
    from spanattn.cache import to_paged

    p = sa.plan(GROUPED, GROUP_LAYERS[layer], device="cuda")
    assert p.groups is not None
    q, k, v = (t.cuda() for t in _qkv(p, 8, 2, torch.bfloat16, seed=9, d=d))
    assert tb.uses_gluon(q, k, v, p, pick_gluon(d, torch.bfloat16))
    out = torch.full_like(q, float("nan"))
    if page is None:
        out, lse = tb.forward(q, k, v, p, scale=d**-0.5, return_lse=True, out=out)
    else:
        kc, vc, table = to_paged(k, v, p, page, fill=float("nan"))
        assert tb.gluon_reads_pages(q, kc.flatten(0, 1), vc.flatten(0, 1), p, pick_gluon(d, q.dtype), page)
        out, lse = tb.forward(q, kc, vc, p, scale=d**-0.5, return_lse=True, out=out, block_table=table)
    assert_close_to_truth(out, lse, q, k, v, p, scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_persistent_programs_walk_many_items(d, programs, monkeypatch):
    """A persistent launch on fewer programs than work items (1, 3 or 7 "SMs": every program
    takes many items as they are dealt at run time, the K/V ring's and the item ring's phases
    running on across items) gives bit for bit what one program per item gives, with causal,
    windowed, span-group and paged steps (NaN in unowned slots); and both meet the truth."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton import gluon_parts
    from spanattn.backends.triton.configs import pick_gluon
    from spanattn.cache import to_paged

    one_per_item = replace(pick_gluon(d, torch.bfloat16), persistent=False)
    monkeypatch.setattr(gluon_parts, "sm_count", lambda device: programs)
    steps = [(LONG, LAYERS["causal"], None), (LONG, LAYERS["W37-clamp"], 64),
             (GROUPED, GROUP_LAYERS["W24_clamp"], None), (GROUPED, GROUP_LAYERS["on"], 16)]  # fmt: skip
    for batch, layer, page in steps:
        p = sa.plan(batch, layer, device="cuda")
        q, k, v = (t.cuda() for t in _qkv(p, 8, 2, torch.bfloat16, seed=11, d=d))
        kv = (k, v, {}) if page is None else to_paged(k, v, p, page, fill=float("nan"))
        opts = {} if page is None else {"block_table": kv[2]}
        outs = []
        for config in (None, one_per_item):
            out = torch.full_like(q, float("nan"))
            outs.append(tb.forward(q, kv[0], kv[1], p, scale=d**-0.5, return_lse=True, out=out,
                                   config=config, **opts))  # fmt: skip
        (out, lse), (out1, lse1) = outs
        assert torch.equal(out, out1) and torch.equal(lse, lse1), (layer, page)
        assert_close_to_truth(out, lse, q, k, v, p, scale=d**-0.5)


@hopper_only
@pytest.mark.parametrize("d", DIMS)
def test_deal_counters_reset_between_launches_and_graph_replays(d, monkeypatch):
    """Items are dealt at run time from counters the last program of a launch sets back to zero
    (gluon_deal): launch after launch, and replay after replay of a captured CUDA graph, every
    item is computed once (the output equals the first call's bit for bit, on 3 "SMs" so that
    each program takes many items)."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton import gluon_parts

    monkeypatch.setattr(gluon_parts, "sm_count", lambda device: 3)
    p = sa.plan(LONG, LAYERS["causal"], device="cuda")
    q, k, v = (t.cuda() for t in _qkv(p, 8, 2, torch.bfloat16, seed=5, d=d))
    first = tb.forward(q, k, v, p, scale=d**-0.5)[0].clone()
    for _ in range(3):
        assert torch.equal(tb.forward(q, k, v, p, scale=d**-0.5)[0], first)
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on a stream of its own: counters of its own, zeroed in the graph
        tb.forward(q, k, v, p, scale=d**-0.5, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@hopper_only
@pytest.mark.parametrize("page", [None, 64])
@pytest.mark.parametrize("layer", ["causal", "W37-clamp"])
def test_halved_items_store_what_whole_items_would(layer, page, monkeypatch):
    """A short step's last items walked in halves on two programs (gluon_halves, d128; here 40
    "SMs": 20 of the 64 items halved, among them 1-tile walks whose second half has no keys)
    meet the truth, bit for bit alike with one program per deal unit, launch after launch (the
    flags wrap back to zero; the scratch holds the last launch's rows) and replay after replay
    of a captured CUDA graph, on causal, windowed and paged (NaN in unowned slots) steps."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton import gluon_parts
    from spanattn.backends.triton.configs import pick_gluon
    from spanattn.cache import to_paged

    d = 128
    one_per_unit = replace(pick_gluon(d, torch.bfloat16), persistent=False)
    monkeypatch.setattr(gluon_parts, "sm_count", lambda device: 40)
    p = sa.plan(LONG, LAYERS[layer], device="cuda")
    q, k, v = (t.cuda() for t in _qkv(p, 8, 2, torch.bfloat16, seed=13, d=d))
    kc, vc, table = (k, v, None) if page is None else to_paged(k, v, p, page, fill=float("nan"))
    opts = {} if table is None else {"block_table": table}

    def run(config=None, out=None):
        out = torch.full_like(q, float("nan")) if out is None else out
        return tb.forward(q, kc, vc, p, scale=d**-0.5, return_lse=True, out=out, config=config, **opts)

    out, lse = (x.clone() for x in run())
    assert_close_to_truth(out, lse, q, k, v, p, scale=d**-0.5)
    out1, lse1 = run(one_per_unit)
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    for _ in range(2):
        again, lse2 = run()
        assert torch.equal(again, out) and torch.equal(lse2, lse)
    replayed = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out=replayed)
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "groups"])
def test_launch_binds_every_kernel_argument(d, paged, grouped, monkeypatch):
    """The host side of a launch, on any machine: the arguments it passes bind to the kernel's
    signature (none missing, none extra), the grid has one program per SM (persistent, here
    5 SMs) or one per deal unit (a work item, query tile and head, or at d128 without span
    groups one half of each of the last 2 = 5 // 2 items' walks), the deal's counters and the
    halved items' flags start at zero, the scratch buffer holds the halves' partial rows and its
    sections hold the KV heads whose K/V fit in L2."""
    import inspect

    from spanattn.backends.triton import GLUON_KERNELS, _gluon_module, gluon_parts
    from spanattn.backends.triton.configs import pick_gluon
    from spanattn.backends.triton.gluon_deal import kv_head_bytes
    from spanattn.backends.triton.schedule_triton import tile_schedule

    cfg = pick_gluon(d, torch.bfloat16)
    module = _gluon_module(GLUON_KERNELS[(d, cfg.block_m)])
    kernel = next(v for k, v in vars(module).items() if k.startswith("attn_fwd_gluon"))
    from spanattn.backends.triton import gluon_group_args

    batch = GROUPED if grouped else LONG
    p = sa.plan(batch, sa.LayerMask())
    q, k, v = _qkv(p, 8, 2, torch.bfloat16, d=d)
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    sched = tile_schedule(p, cfg.block_m, cfg.block_n)
    table = torch.zeros(len(batch.seqs), 4, dtype=torch.int32) if paged else None
    page = 256 if paged else 0
    groups = gluon_group_args(p, sched)
    assert (groups is not None) == grouped
    monkeypatch.setattr(gluon_parts, "sm_count", lambda device: 5)
    monkeypatch.setattr(gluon_parts, "l2_bytes", lambda device: kv_head_bytes(p.total_k, d, 2))  # bf16
    out = q.clone()
    for persistent in (False, True):
        launch = module.launch.func(
            Recorder(), *module.launch.args[1:], q, k, v, p, sched, out.stride(), False, False,
            cfg.num_stages, paged=paged, page_size=page, bt_stride=4 if paged else 0, groups=groups,
            persistent=persistent, **module.launch.keywords,
        )  # fmt: skip
        launch(q, k, v, out, None, 0.1, 1.0, table)
    (grid, args, kwargs), (grid_persistent, args_persistent, _) = calls
    halves = 2 if d == 128 and not grouped else 0
    units = sched.num_tiles * 8 + halves
    assert grid == (units, 1, 1) and grid_persistent == (5, 1, 1)
    assert len(args) == len(args_persistent) and kwargs.pop("num_warps") == 4  # a launch option
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    assert bound.arguments["num_items"] == units and bound.arguments["halves"] == halves
    deal = bound.arguments["DEAL"]
    assert deal.dtype == torch.int32 and deal.tolist() == [0, 0] + [0] * 8 * halves  # 8 warps an item
    scratch = bound.arguments["WS"]
    assert scratch.dtype == torch.float32 and scratch.numel() == max(halves * 2 * 128 * (d + 2), 1)
    assert bound.arguments["section"] == 1  # of the two KV heads, one fits
    assert bound.arguments["PAGE"] == page and bound.arguments["GROUP"] == 4
    assert bound.arguments["GROUPS"] == grouped and not bound.arguments["CLAMP"]
    if grouped:
        assert bound.arguments["WALK_INFO"].shape == (sched.num_tiles, 4)


def test_a_gluon_module_this_triton_cannot_import_means_no_gluon(monkeypatch):
    # a release whose Gluon lacks a name the kernels read off a module (gluon.constexpr_function,
    # say): the plain kernel, no crash
    import importlib

    from spanattn.backends import triton as tb

    def missing(name):
        raise AttributeError("module 'triton.experimental.gluon' has no attribute 'constexpr_function'")

    monkeypatch.setattr(importlib, "import_module", missing)
    tb._gluon_module.cache_clear()
    try:
        assert tb._gluon_module("kernel_gluon") is None
    finally:
        monkeypatch.undo()
        tb._gluon_module.cache_clear()
