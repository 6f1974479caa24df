"""The Gluon kernels' span-group walk (backends/triton/group_walk.py): every schedule tile's key
tiles (pre, interval walk, post) and the three ways a tile is masked (none, per row, per key),
followed tile by tile on CPU and held exactly to the dense mask: each allowed (query, key) pair
counted once, no other pair ever. The kernels themselves are checked on the GPU
(test_groups_backends.py); this checks the walk and the mask rule they are built on."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import grouped_batches, layers
from test_tiles import packed_dense

import spanattn as sa

pytest.importorskip("triton")
from spanattn.backends.triton.columns import INFO, WALK  # noqa: E402
from spanattn.backends.triton.group_walk import group_walk, key_tile_groups  # noqa: E402
from spanattn.backends.triton.schedule import build_schedule  # noqa: E402


def walked(plan, bm: int, bn: int, paged: bool) -> torch.Tensor:
    """How often each (query row, key row) pair is let through, walking each tile as the Gluon
    kernels do: packed K/V read the tile across a sequence's end shifted back to end with it,
    pages read it in place (keys past the end masked)."""
    sched = build_schedule(plan, bm, bn)
    walk = group_walk(plan, sched)
    ktg = key_tile_groups(plan.groups, bn)
    g = plan.groups
    count = torch.zeros(plan.total_q, plan.total_k, dtype=torch.int64)
    for info, w in zip(sched.info.tolist(), walk.tolist()):
        t, w = dict(zip(INFO, info)), dict(zip(WALK, w))
        rows = torch.arange(t["q_row0"], t["q_row_last"] + 1)
        lo, hi = plan.lo[rows].long(), plan.hi[rows].long()
        gq = g.q_group[rows].long()
        gsel = torch.where(gq >= 0, gq, -2)
        k0, kv_len = t["k_row0"], t["kv_len"]
        main = list(range(t["kv_start"], t["kv_end"], bn))
        pre = [w["pre_start"] + i * bn for i in range(w["pre_tiles"])]
        post = [w["post_start"] + i * bn for i in range(w["post_tiles"])]
        assert not set(pre) & set(main) and not set(post) & set(main) and not set(pre) & set(post)
        for n in pre + main + post:
            outside = n not in main
            kv = (n if paged else min(n, kv_len - bn)) + torch.arange(bn)
            code = ktg[k0 + min(n, kv_len - bn)].item() if n + bn <= kv_len else -1
            inside = (kv >= n) & (kv < kv_len)  # keys below n: seen already (the shifted tile)
            gk = torch.where(inside, g.k_group[(k0 + kv).clamp_max(plan.total_k - 1)].long(), -1)
            same = gk[None, :] == gsel[:, None]
            if outside and code >= 0:  # a row compare and a column compare
                col = torch.arange(bn)
                cols = (col < (code & 255)) | (col >= (code >> 8 & 255))
                ok = (gsel == code >> 16)[:, None] & cols[None, :]
            elif outside:  # per key, groups alone
                ok = same
            elif n < t["full_start"] or n + bn > t["full_end"]:  # per key
                keep = (kv >= torch.maximum(lo, torch.tensor(n))[:, None]) & (kv <= hi[:, None])
                ok = keep | (same & (kv >= lo[:, None]) if g.clamp else same)
            else:  # FULL
                ok = torch.ones(len(rows), bn, dtype=torch.bool)
            ok &= kv < kv_len  # a paged tile's keys past the end (packed: none)
            cols = (k0 + kv).clamp_max(plan.total_k - 1)
            index = (rows[:, None].expand(-1, bn), cols[None, :].expand(len(rows), -1))
            count.index_put_(index, ok.long(), accumulate=True)
    return count


@settings(max_examples=60, deadline=None)
@given(
    batch=grouped_batches(max_len=400),
    layer=layers(max_window=320),
    tiles=st.sampled_from([(128, 128), (128, 64), (64, 32), (16, 16)]),
    paged=st.booleans(),
)
def test_walk_lets_through_exactly_the_allowed_pairs(batch, layer, tiles, paged):
    bm, bn = tiles
    p = sa.plan(batch, layer)
    assume(p.groups is not None and p.min_seqlen_k >= bn)  # the Gluon kernels' precondition
    assert torch.equal(walked(p, bm, bn, paged), packed_dense(p).long())


def test_video_walk_skips_nothing_and_masks_whole_frame_tiles_per_row():
    """Frames of 256 tokens 16 apart: a tile holding frame rows walks on from the end of its
    interval walk (its last frame's end) to the end of the last frame; key tiles inside one frame
    carry its group code, tiles holding one run of text beside a frame too, with the text's
    offsets; tiles holding two groups or two runs of text carry none."""
    frames = [(16 + 272 * i, 16 + 272 * i + 255, 0) for i in range(6)]
    p = sa.plan(sa.Batch([sa.Seq(6 * 272, spans=frames)]), sa.LayerMask())
    sched = build_schedule(p, 128, 128)
    walk = dict(zip(WALK, group_walk(p, sched)[sched.column("q_row0") == 256].flatten().tolist()))
    assert walk == {"pre_start": 0, "pre_tiles": 0, "post_start": 640, "post_tiles": 8}
    code = lambda g, a, b: g << 16 | b << 8 | a
    ktg = key_tile_groups(p.groups, 128)
    # whole in frame 0; frame 0's end, text 272..287, frame 1's start; text 0..15 then frame 0
    assert ktg[[16, 144, 256, 0]].tolist() == [code(0, 0, 0)] * 2 + [code(0, 16, 32), code(0, 0, 16)]
    spans = [(0, 9, 0), (20, 29, 0), (40, 49, 1), (55, 60, 1)]
    two = sa.plan(sa.Batch([sa.Seq(64, spans=spans)]), sa.LayerMask()).groups
    codes = [code(0, 10, 16), code(0, 6, 16), code(1, 10, 15)]
    assert key_tile_groups(two, 16)[[0, 24, 40]].tolist() == codes
    assert key_tile_groups(two, 32)[[20, 8]].tolist() == [-1, -1]  # two groups; two runs of text


def test_clamp_walks_no_keys_before_the_window():
    frames = [(16 + 80 * i, 16 + 80 * i + 63, 0) for i in range(8)]
    p = sa.plan(sa.Batch([sa.Seq(640, spans=frames)]), sa.LayerMask(window=100, spans="clamp"))
    walk = group_walk(p, build_schedule(p, 64, 32))
    assert walk[:, WALK.index("pre_tiles")].eq(0).all() and walk[:, WALK.index("post_tiles")].gt(0).any()
