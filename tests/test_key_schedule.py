"""The backward's tables, exactly: span groups' key- and query-tile runs (groups.tile_runs,
groups.query_tile_runs) against runs read off each row's group, the dK/dV pass's key-tile
schedule (backends/triton/key_schedule.py) against the dense interval mask read by columns, and
the dK/dV kernel's walk over them (hull, FULL tiles, group runs, clamp's skipped queries)
followed tile by tile on CPU: every allowed (query, key) pair counted once, no other pair."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, grouped_batches, layers
from test_device_planner import inputs, planner_for
from test_tiles import packed_dense

import spanattn as sa
from spanattn.groups import query_tile_runs, tile_runs
from spanattn.intervals import dense_from_intervals

pytest.importorskip("triton")
from spanattn.backends.triton.columns import KEY_INFO  # noqa: E402
from spanattn.backends.triton.key_schedule import (  # noqa: E402
    build_key_schedule,
    key_schedule,
    query_group_args,
)


def runs_by_definition(ids: list[int], block: int, num_groups: int) -> list[list[tuple[int, int]]]:
    """Per group, its maximal runs of consecutive ``block``-row tiles holding a row of it, each
    as ``(first row of its first tile, last row of the group in it + 1)``: ``ids`` are one
    sequence's rows' groups (-1: none)."""
    out = [[] for _ in range(num_groups)]
    tiles = -(-len(ids) // block)
    for g in range(num_groups):
        held = [t for t in range(tiles) if g in ids[t * block : (t + 1) * block]]
        for t in held:
            last = max(r for r in range(t * block, min(len(ids), (t + 1) * block)) if ids[r] == g) + 1
            if out[g] and out[g][-1][1] > (t - 1) * block:  # the previous tile was the group's
                out[g][-1] = (out[g][-1][0], last)
            else:
                out[g].append((t * block, last))
    return out


def runs_of(runs: torch.Tensor, index: torch.Tensor) -> list[list[tuple[int, int]]]:
    return [[tuple(r) for r in runs[a:b].tolist()] for a, b in index.tolist()]


def assert_runs(plan: sa.Plan, block: int):
    """Both tables against the definition, sequence by sequence (a group lives in one)."""
    g = plan.groups
    want_k, want_q = [[] for _ in range(g.num_groups)], [[] for _ in range(g.num_groups)]
    for _, q0, q1, k0, kv_len in plan.host_layout():
        for want, ids in ((want_k, g.k_group[k0 : k0 + kv_len]), (want_q, g.q_group[q0:q1])):
            for group, runs in enumerate(runs_by_definition(ids.tolist(), block, g.num_groups)):
                want[group] += runs
    assert runs_of(*tile_runs(g, plan.cu_seqlens_k, block)) == want_k
    assert runs_of(*query_tile_runs(g, plan.cu_seqlens_q, plan.cu_seqlens_k, block)) == want_q


@settings(max_examples=150, deadline=None)
@given(batch=grouped_batches(), block=st.sampled_from([1, 16, 32, 64]))
def test_tile_runs_equal_their_definition(batch, block):
    p = sa.plan(batch, sa.LayerMask())
    if p.groups is not None:
        assert_runs(p, block)


def test_query_runs_of_groups_in_the_cache():
    """Spans wholly before the chunk hold no query: no run; a span across its start begins at
    query 0; a group with no query in the step has an empty row range."""
    seqs = [
        sa.Seq(q_len=20, kv_len=50, spans=[(2, 5, 0), (20, 35, 0), (46, 47, 0)]),
        sa.Seq(q_len=4, kv_len=40, spans=[(1, 3, 0), (6, 8, 0)]),
    ]
    p = sa.plan(sa.Batch(seqs), sa.LayerMask())
    runs, index = query_tile_runs(p.groups, p.cu_seqlens_q, p.cu_seqlens_k, 8)
    assert runs_of(runs, index) == [[(0, 6), (16, 18)], []]  # 20..35: queries 0..5; 46, 47: 16, 17
    assert_runs(p, 8)


def schedule_by_definition(plan: sa.Plan, bm: int, bn: int) -> dict[tuple[int, int], tuple]:
    """(k_row0, n_start) -> (q_start, q_end, FULL query tiles) of every key tile, read off the
    dense interval mask of each sequence by columns."""
    out = {}
    for _, q0, q1, k0, kv_len in plan.host_layout():
        dense = dense_from_intervals(plan.lo[q0:q1], plan.hi[q0:q1], kv_len)
        for n in range(0, kv_len, bn):
            cols = dense[:, n : n + bn]
            seen = cols.any(1).nonzero().flatten().tolist()
            start, end = (min(seen) // bm * bm, max(seen) + 1) if seen else (0, 0)
            full = [m for m in range(0, q1 - q0 - bm + 1, bm) if cols[m : m + bm].all()]
            out[(k0, n)] = (start, end, full)
    return out


def assert_schedule(plan: sa.Plan, bm: int, bn: int):
    sched = build_key_schedule(plan, bm, bn)
    want = schedule_by_definition(plan, bm, bn)
    got = {}
    for row in sched.info.tolist():
        t = dict(zip(KEY_INFO, row))
        full = list(range(t["full_start"], t["full_end"], bm))
        assert t["full_end"] == t["full_start"] or t["full_end"] % bm == 0
        assert t["q_start"] <= t["full_start"] <= t["full_end"] <= t["q_end"]
        got[(t["k_row0"], t["n_start"])] = (t["q_start"], t["q_end"], full)
        i = plan.cu_seqlens_k.tolist().index(t["k_row0"])
        assert (t["kv_len"], t["q_row0"], t["q_len"]) == (
            plan.batch.seqs[i].kv_len, plan.cu_seqlens_q[i].item(), plan.batch.seqs[i].q_len,
        )  # fmt: skip
    assert sched.info.shape[0] == len(want) and got == want
    cost = sched.tile_cost.tolist()
    assert cost == sorted(cost, reverse=True)


@settings(max_examples=80, deadline=None)
@given(
    batch=batches(max_seqs=4, max_len=200),
    layer=layers(max_window=200),
    tiles=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 128)]),
)
def test_key_schedule_equals_the_dense_mask_read_by_columns(batch, layer, tiles):
    assert_schedule(sa.plan(batch, layer), *tiles)


def test_key_schedule_edges():
    """A cached key behind every window (no query sees it: the tile walks nothing), keys at
    tile edges, a decode row, a canvas, an image wider than the window; cached per plan."""
    seqs = [sa.Seq(q_len=20, kv_len=70, spans=[(30, 60)]), sa.Seq(q_len=1, kv_len=33),
            sa.Seq(q_len=32, causal=False), sa.Seq(q_len=17, kv_len=17)]  # fmt: skip
    for layer in (sa.LayerMask(window=5, spans="clamp"), sa.LayerMask(), sa.LayerMask(window=3, spans="on")):
        p = sa.plan(sa.Batch(seqs), layer)
        for tiles in ((16, 16), (16, 32), (32, 16)):
            assert_schedule(p, *tiles)
    p = sa.plan(sa.Batch(seqs), sa.LayerMask(window=5, spans="clamp"))
    first = dict(zip(KEY_INFO, build_key_schedule(p, 16, 16, lpt=False).info[0].tolist()))
    assert first["q_start"] == first["q_end"] == first["full_end"] == 0  # keys 0..15 behind every window
    assert key_schedule(p, 16, 16) is key_schedule(p, 16, 16)


def walked(plan: sa.Plan, bm: int, bn: int) -> torch.Tensor:
    """How often the dK/dV kernel lets each (query row, key row) pair through, following its
    walk tile by tile: the hull's query tiles (FULL ones unmasked, asserted wholly allowed),
    then for each group of the tile's keys its query-tile runs before the hull and, but in clamp
    mode, after it, masked to the group (mask.tile_mask's predicate). Clamp's runs after the
    hull are walked too, asserted to let no pair through (the kernel skips them)."""
    g = plan.groups
    if g is not None:
        _, _, index, runs = query_group_args(plan, bm)
    count = torch.zeros(plan.total_q, plan.total_k, dtype=torch.int64)
    skipped = torch.zeros_like(count)
    for row in key_schedule(plan, bm, bn).info.tolist():
        t = dict(zip(KEY_INFO, row))
        walk_tiles(plan, t, bm, bn, t["q_start"], t["full_start"], count)
        walk_tiles(plan, t, bm, bn, t["full_start"], t["full_end"], count, full=True)
        walk_tiles(plan, t, bm, bn, t["full_end"], t["q_end"], count)
        if g is None:
            continue
        main_end = t["q_start"] + -(-(t["q_end"] - t["q_start"]) // bm) * bm
        keys = slice(t["k_row0"] + t["n_start"], t["k_row0"] + min(t["n_start"] + bn, t["kv_len"]))
        for group in sorted({x for x in g.k_group[keys].tolist() if x >= 0}):
            for a, b in runs[index[group, 0] : index[group, 1]].tolist():
                walk_tiles(plan, t, bm, bn, a, min(b, t["q_start"]), count, group)
                walk_tiles(plan, t, bm, bn, max(a, main_end), b, skipped if g.clamp else count, group)
    assert not skipped.any()  # clamp: no query after the hull sees a key through its group
    return count


def walk_tiles(plan, t: dict, bm: int, bn: int, start: int, end: int, into, group=None, full=False):
    """Add to ``into`` the pairs of key tile ``t`` (a KEY_INFO row) and query tiles ``[start,
    end)`` let through: all (``full``), or those the mask allows, its group part limited to
    ``group`` if given."""
    g, k0, q0 = plan.groups, t["k_row0"], t["q_row0"]
    kv = torch.arange(t["n_start"], min(t["n_start"] + bn, t["kv_len"]))
    for m in range(start, end, bm):
        rows = torch.arange(m, min(m + bm, t["q_len"]))
        lo, hi = plan.lo[q0 + rows].long()[:, None], plan.hi[q0 + rows].long()[:, None]
        ok = (kv[None, :] >= lo) & (kv[None, :] <= hi)
        if full:
            assert len(rows) == bm and ok.all()
        elif g is not None:
            gq, gk = g.q_group[q0 + rows].long(), g.k_group[k0 + kv].long()
            gsel = torch.where((gq >= 0) & ((gq == group) if group is not None else True), gq, -2)
            same = gk[None, :] == gsel[:, None]
            ok |= same & (kv[None, :] >= lo) if g.clamp else same
        cells = (q0 + rows)[:, None].expand(-1, len(kv)), (k0 + kv)[None, :].expand(len(rows), -1)
        into.index_put_(cells, ok.long(), accumulate=True)


@settings(max_examples=60, deadline=None)
@given(
    batch=grouped_batches(),
    layer=layers(max_window=300),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 64)]),
)
def test_dkdv_walk_lets_through_exactly_the_allowed_pairs(batch, layer, tiles):
    p = sa.plan(batch, layer)
    assert torch.equal(walked(p, *tiles), packed_dense(p).long())


@settings(max_examples=30, deadline=None)
@given(batch=batches(max_seqs=3, max_len=150), layer=layers(max_window=150))
def test_dkdv_walk_without_groups(batch, layer):
    p = sa.plan(batch, layer)
    assert torch.equal(walked(p, 16, 32), packed_dense(p).long())


@settings(max_examples=60, deadline=None)
@given(
    batch=batches(max_seqs=4, max_len=120), layer=layers(max_window=130),
    tiles=st.sampled_from([(16, 16), (32, 64), (64, 16)]), slack=st.integers(0, 40),
)  # fmt: skip
def test_device_plan_key_schedule_is_the_host_plans(batch, layer, tiles, slack):
    # built on the device from a DevicePlanner's step (columns from its rows): the host plan's
    # tiles in the same order, then capacity's empty tiles (key 1 of a one-key sequence, no walk)
    planner = planner_for(batch, {"l": layer}, slack=slack)
    dplan = planner.update(*inputs(batch))["l"]
    host = build_key_schedule(sa.plan(batch, layer, dplan.device), *tiles)
    dev = build_key_schedule(dplan, *tiles)
    n = host.num_tiles
    assert torch.equal(dev.info[:n], host.info) and torch.equal(dev.tile_cost[:n], host.tile_cost)
    empty = torch.tensor([{"kv_len": 1, "n_start": 1}.get(c, 0) for c in KEY_INFO], dtype=torch.int32)
    assert torch.equal(dev.info[n:].cpu(), empty.expand(dev.num_tiles - n, -1))
    assert not dev.tile_cost[n:].any()
