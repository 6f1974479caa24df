"""Span groups for the Gluon kernels: each schedule tile's walk outside its interval range, and
which key tiles hold one group's keys (beside at most one run of keys in no group).

kernel.py walks a group's keys beyond a tile's interval range run by run (groups.tile_runs),
once per group of the tile's rows. The Gluon kernels' producer and consumers must agree on one
sequence of key tiles without per-group loops, so a tile's walk is three ranges of key tiles:
``pre`` (group keys before the interval walk; global and ``on`` layers only), the interval walk
``[kv_start, kv_end)`` and ``post`` (group keys after it), each range the hull of the tile's rows'
groups' keys there (``SpanGroups.extents``). Tiles of the hull that hold none of a row's group
keys are walked and masked: text between the spans of one group (a few timestamp tokens between
video frames) costs its tiles once, text that sits between a group's spans for thousands of
tokens would cost those tiles too.

A key tile whose keys all belong to one group but for one run in no group (``key_tile_groups``:
a video frame and the timestamp text beside it) is masked by a row compare and a column compare,
not by a lookup per key: outside the interval walk a row sees the tile's group keys or none.

Both functions here are the definitions, in torch ops (launch-bound on a GPU); on CUDA the
schedule launch writes the walk (schedule_triton.py) and key_tile_groups_triton.py builds the
key tile groups, each in one launch, held equal to these by the tests.
"""

from __future__ import annotations

import torch

from .columns import INFO, WALK


def group_walk(plan, sched) -> torch.Tensor:
    """int32 ``[sched.num_tiles, len(WALK)]`` (columns.WALK) for ``plan.groups``, in ``sched``'s
    tile order and ``sched.block_n``-key tiles, positions in the tile's sequence."""
    g, bm, bn = plan.groups, sched.block_m, sched.block_n
    col = lambda name: sched.info[:, INFO.index(name)].long()
    q_row0, q_row_last, k_row0 = col("q_row0"), col("q_row_last"), col("k_row0")
    rows = q_row0[:, None] + torch.arange(bm, device=q_row0.device)
    gq = g.q_group.long()[rows.clamp_max(g.q_group.numel() - 1)]
    grouped = (rows <= q_row_last[:, None]) & (gq >= 0)
    ext = g.extents.long()[gq.clamp_min(0)] - k_row0[:, None, None]  # [tiles, bm, (first, last)]
    first = torch.where(grouped, ext[..., 0], 2**31 - 1).amin(1)
    last = torch.where(grouped, ext[..., 1], -1).amax(1)
    kv_start, kv_end = col("kv_start"), col("kv_end")
    post_start = kv_start + (kv_end - kv_start + bn - 1) // bn * bn
    post_tiles = ((last + 1 - post_start + bn - 1) // bn).clamp_min(0)
    zero = torch.zeros_like(kv_start)
    if g.clamp:  # group keys below a row's lo are not allowed, and lo >= kv_start
        pre_start, pre_tiles = zero, zero
    else:
        has = first < kv_start
        pre_start = torch.where(has, first // bn * bn, zero)
        pre_tiles = torch.where(has, (kv_start - pre_start) // bn, zero)
    cols = dict(pre_start=pre_start, pre_tiles=pre_tiles, post_start=post_start, post_tiles=post_tiles)
    return torch.stack([cols[c] for c in WALK], 1).to(torch.int32).contiguous()


def key_tile_groups(groups, block_n: int) -> torch.Tensor:
    """int32 ``[key rows]``: at row ``r``, for keys ``r ... r + block_n - 1``, ``g << 16 | b << 8 |
    a`` if every key of them at a tile offset outside ``[a, b)`` belongs to group ``g`` and those
    inside to none (``a == b == 0``: the whole tile is the group's); -1 otherwise (keys of two
    groups, text in two runs, ``g`` past 15 bits). A key tile of a video holds one frame's keys
    and at most one run of timestamp text, so each of them is masked by a row and a column
    compare. Group ids are unique across a step's sequences, so a tile across a sequence boundary
    holds two groups or none."""
    kg = groups.k_group
    pad = torch.cat([kg, kg.new_full((block_n - 1,), -1)])
    windows = pad.unfold(0, block_n, 1)  # [key rows, block_n], a view
    g = windows.amax(1)
    one_group = torch.where(windows >= 0, windows, 2**31 - 1).amin(1) == g
    none = windows < 0
    count = none.sum(1)
    a = none.int().argmax(1)  # the first key in no group (0 if none)
    b = block_n - none.flip(1).int().argmax(1)  # past the last one
    one_run = (count == 0) | (b - a == count)
    a, b = torch.where(count > 0, a, 0), torch.where(count > 0, b, 0)
    ok = (g >= 0) & (g < 2**15) & one_group & one_run
    return torch.where(ok, (g << 16) | (b << 8) | a, -1).to(torch.int32).contiguous()
