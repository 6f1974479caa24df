"""The tile schedule of one step: which queries each program handles and which keys it walks,
heaviest tiles first; its definition in torch ops (no per-token Python loop, no device sync).
schedule_triton.py builds the same table in one launch and caches it on the plan, so every
layer of the step reuses it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .columns import INFO
from .group_walk import group_walk


@dataclass(frozen=True)
class TileSchedule:
    """``info``: int32 ``[num_tiles, len(INFO)]`` in launch order (heaviest first): the tile's
    first and last query rows (packed), its sequence's first key row and length, the sequence,
    and its key walk for ``block_n``-key tiles: ``[kv_start, kv_end)`` with the FULL tiles in
    ``[full_start, full_end)`` (docs/design.md section 2; the bounds are multiples of ``block_n``
    except ``kv_end``). ``tile_cost``: keys each tile walks (``max hi - min lo + 1``, widened to
    the keys of its rows' span groups). ``walk``: for a plan with span groups, int32
    ``[num_tiles, len(WALK)]`` in the same order, the Gluon kernels' walk outside each tile's
    interval range (group_walk.py); None without groups."""

    block_m: int
    block_n: int
    info: torch.Tensor
    tile_cost: torch.Tensor
    walk: torch.Tensor | None = None

    @property
    def num_tiles(self) -> int:
        return self.info.shape[0]

    def column(self, name: str) -> torch.Tensor:
        return self.info[:, INFO.index(name)]

    def key_tiles(self) -> torch.Tensor:
        """Each tile's interval walk in key tiles: ``[kv_start, kv_end)`` in ``block_n``-key tiles
        (0 for a tile whose walk is empty)."""
        keys = (self.column("kv_end") - self.column("kv_start")).clamp_min(0)
        return (keys + self.block_n - 1) // self.block_n


def tile_starts(lengths: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side, O(tiles): the sequence and first row (in the sequence) of each tile of
    ``block`` rows over sequences of ``lengths`` rows (queries here, keys for the backward's
    key tiles), int64. Python lists, not torch CPU ops: after torch.compile has run in the
    process, even a searchsorted over 256 tiles took 7-8 ms per step on the H200 machine (0.4 ms
    before), where this costs microseconds per hundred tiles."""
    seqs, starts = [], []
    for i, length in enumerate(lengths):
        n = -(-length // block)
        seqs += [i] * n
        starts += range(0, n * block, block)
    return torch.tensor(seqs, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)


def device_tile_starts(cu_seqlens: torch.Tensor, total: int, block: int):
    """:func:`tile_starts` on the device without a host read (a device plan's): room for the most
    tiles a step of ``total`` rows over ``n = len(cu_seqlens) - 1`` sequences can have,
    ``cdiv(total, block) + n``, the step's first. ``(tile_seq, start, first_tile, live)``, int64:
    each tile's sequence (clamped to the last) and first row in it, each sequence's first tile,
    and which tiles hold rows."""
    n = cu_seqlens.numel() - 1
    tiles = (cu_seqlens.long().diff() + block - 1) // block
    ends = tiles.cumsum(0)
    t = torch.arange(-(-total // block) + n, device=cu_seqlens.device)
    tile_seq = torch.searchsorted(ends, t, right=True)
    live = tile_seq < n
    tile_seq = tile_seq.clamp_max(n - 1)
    first_tile = ends - tiles
    return tile_seq, (t - first_tile[tile_seq]) * block, first_tile, live


def build_schedule(plan, block_m: int, block_n: int, lpt: bool = True) -> TileSchedule:
    """Split every sequence's queries into tiles of ``block_m`` and order them longest first
    (LPT: the long causal tiles start first so the short ones fill the tail of the launch).
    The definition, in torch ops; CUDA builds the same table in one launch (schedule_triton.py)."""
    tile_seq, tile_qstart = tile_starts([s.q_len for s in plan.batch.seqs], block_m)
    total = tile_seq.shape[0]
    dev = plan.device
    tile_seq = tile_seq.to(dev)
    tile_qstart = tile_qstart.to(dev)
    cu_q, cu_k = plan.cu_seqlens_q.long(), plan.cu_seqlens_k.long()
    q_row0 = cu_q[tile_seq] + tile_qstart
    # O(tokens): each tile's interval extremes
    token = torch.arange(plan.total_q, device=dev)
    token_seq = plan.query_seq_ids()
    first_tile = torch.searchsorted(tile_seq, torch.arange(plan.num_seqs, device=dev))
    token_tile = first_tile[token_seq] + (token - cu_q[token_seq]) // block_m

    def reduce(values, how, init):
        out = torch.full((total,), init, dtype=torch.int64, device=dev)
        return out.scatter_reduce(0, token_tile, values.long(), how)

    lo_min, lo_max = reduce(plan.lo, "amin", 2**31 - 1), reduce(plan.lo, "amax", -1)
    hi_min, hi_max = reduce(plan.hi, "amin", 2**31 - 1), reduce(plan.hi, "amax", -1)
    q_row_last = torch.minimum(q_row0 + block_m, cu_q[tile_seq + 1]) - 1
    info, cost = tile_columns(
        q_row0, q_row_last, cu_k, tile_seq, lo_min, lo_max, hi_min, hi_max, block_n
    )  # fmt: skip
    g = plan.groups
    if g is not None:  # span groups: the cost spans the rows' groups' keys as well
        ext = g.extents.long()[g.q_group.long().clamp_min(0)] - cu_k[token_seq][:, None]
        grouped = g.q_group >= 0
        first = reduce(torch.where(grouped, ext[:, 0], 2**31 - 1), "amin", 2**31 - 1)
        last = reduce(torch.where(grouped, ext[:, 1], -1), "amax", -1)
        low = lo_min if g.clamp else torch.minimum(lo_min, first)
        cost = (torch.maximum(hi_max, last) - low + 1).to(torch.int32)
        sched = ordered(block_m, block_n, info, cost, lpt)
        return replace(sched, walk=group_walk(plan, sched))
    return ordered(block_m, block_n, info, cost, lpt)


def tile_columns(q_row0, q_row_last, cu_k, tile_seq, lo_min, lo_max, hi_min, hi_max, block_n):
    """``info`` (INFO's columns) and ``tile_cost`` of tiles from their rows and interval extremes
    (int64 ``[tiles]`` each): the key walk of docs/design.md section 2, in ``block_n``-key tiles."""
    kv_end = hi_max + 1
    full_start = torch.minimum((lo_max + block_n - 1) // block_n * block_n, kv_end)
    cols = {
        "q_row0": q_row0,
        "q_row_last": q_row_last,
        "k_row0": cu_k[tile_seq],
        "kv_len": cu_k[tile_seq + 1] - cu_k[tile_seq],
        "seq": tile_seq,
        "kv_start": lo_min // block_n * block_n,
        "kv_end": kv_end,
        "full_start": full_start,
        "full_end": torch.maximum((hi_min + 1) // block_n * block_n, full_start),
    }
    info = torch.stack([cols[c] for c in INFO], 1).to(torch.int32)
    return info, (hi_max - lo_min + 1).to(torch.int32)


def build_device_schedule(plan, block_m: int, block_n: int, lpt: bool = True, out=None) -> TileSchedule:
    """The schedule of a device plan (device_plan.py), built on the device without a sync: room
    for the most tiles a step of its capacity can have, ``cdiv(max_tokens, block_m) +
    max_seqs``, the step's tiles first and the rest empty (``q_row0 = 1 > q_row_last = 0``, no
    keys, cost 0: the kernel walks and stores nothing for them). ``out``: a schedule of this
    shape to rewrite in place (a captured graph keeps reading the same tensors)."""
    total, dev = plan.total_q, plan.device
    cu_q, cu_k = plan.cu_seqlens_q.long(), plan.cu_seqlens_k.long()
    tile_seq, start, _, live = device_tile_starts(plan.cu_seqlens_q, total, block_m)
    q_row0 = cu_q[tile_seq] + start
    q_end = torch.minimum(q_row0 + block_m, cu_q[tile_seq + 1])
    rows = q_row0[:, None] + torch.arange(block_m, device=dev)
    valid = (rows < q_end[:, None]) & live[:, None]
    rows = rows.clamp(0, total - 1)
    lo, hi = plan.lo.long()[rows], plan.hi.long()[rows]
    extreme = lambda x, how, init: getattr(torch.where(valid, x, init), how)(1)
    lo_min, lo_max = extreme(lo, "amin", 2**31 - 1), extreme(lo, "amax", -1)
    hi_min, hi_max = extreme(hi, "amin", 2**31 - 1), extreme(hi, "amax", -1)
    info, cost = tile_columns(q_row0, q_end - 1, cu_k, tile_seq, lo_min, lo_max, hi_min, hi_max, block_n)
    # The row from a one-hot compare, not an item store: storing a Python number into a device
    # tensor is a host-to-device copy, which a CUDA graph capture refuses.
    empty = (torch.arange(len(INFO), device=dev) == INFO.index("q_row0")).to(torch.int32)
    info = torch.where(live[:, None], info, empty)
    cost = torch.where(live, cost, 0)
    sched = ordered(block_m, block_n, info, cost, lpt)
    if out is None:
        return sched
    out.info.copy_(sched.info)
    out.tile_cost.copy_(sched.tile_cost)
    return out


def ordered(block_m, block_n, info, cost, lpt: bool, walk=None) -> TileSchedule:
    """The schedule with its tiles heaviest first (``lpt``) or in sequence order; ``walk``'s rows
    follow their tiles."""
    if lpt:
        order = torch.argsort(cost, descending=True, stable=True)
        info, cost = info[order], cost[order]
        walk = None if walk is None else walk[order]
    walk = None if walk is None else walk.contiguous()
    return TileSchedule(block_m, block_n, info.contiguous(), cost.contiguous(), walk)
