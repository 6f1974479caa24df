"""The tile schedule of one step: which sequence and first query each program handles, heaviest
tiles first. Built with a few vectorized torch ops per plan (no per-token Python loop, no device
sync) and cached on the plan, so every layer of the step reuses it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileSchedule:
    """``tile_seq``/``tile_qstart``: int32 ``[num_tiles]``, in launch order (heaviest first).
    ``tile_cost``: int32 ``[num_tiles]`` keys each tile walks (``max hi - min lo + 1``), same order."""

    block_m: int
    tile_seq: torch.Tensor
    tile_qstart: torch.Tensor
    tile_cost: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_seq.shape[0]


def build_schedule(plan, block_m: int, lpt: bool = True) -> TileSchedule:
    """Split every sequence's queries into tiles of ``block_m`` and order them longest first
    (LPT: the long causal tiles start first so the short ones fill the tail of the launch)."""
    q_lens = torch.tensor([s.q_len for s in plan.batch.seqs], dtype=torch.int64)
    n_tiles = (q_lens + block_m - 1) // block_m
    total = int(n_tiles.sum())
    # Host side, O(tiles): sequence and first query of each tile. searchsorted, not
    # repeat_interleave: the latter costs milliseconds on CPU even for a few hundred elements.
    ends = torch.cumsum(n_tiles, 0)
    tile_seq = torch.searchsorted(ends, torch.arange(total), right=True)
    tile_qstart = (torch.arange(total) - (ends - n_tiles)[tile_seq]) * block_m

    dev = plan.device
    tile_seq = tile_seq.to(dev, non_blocking=True)
    tile_qstart = tile_qstart.to(dev, non_blocking=True)
    first_tile = (ends - n_tiles).to(dev, non_blocking=True)
    # Device side, O(tokens): each tile's key range from the intervals (the kernel recomputes it;
    # here it only ranks tiles).
    cu_q = plan.cu_seqlens_q.long()
    token = torch.arange(plan.total_q, device=dev)
    token_seq = plan.query_seq_ids()
    token_tile = first_tile[token_seq] + (token - cu_q[token_seq]) // block_m
    lo_min = torch.full((total,), 2**31 - 1, dtype=torch.int32, device=dev)
    lo_min = lo_min.scatter_reduce(0, token_tile, plan.lo, "amin")
    hi_max = torch.full((total,), -1, dtype=torch.int32, device=dev)
    hi_max = hi_max.scatter_reduce(0, token_tile, plan.hi, "amax")
    cost = hi_max - lo_min + 1
    if lpt:
        order = torch.argsort(cost, descending=True, stable=True)
        tile_seq, tile_qstart, cost = tile_seq[order], tile_qstart[order], cost[order]
    return TileSchedule(
        block_m=block_m,
        tile_seq=tile_seq.to(torch.int32).contiguous(),
        tile_qstart=tile_qstart.to(torch.int32).contiguous(),
        tile_cost=cost.to(torch.int32).contiguous(),
    )


def tile_schedule(plan, block_m: int, lpt: bool = True) -> TileSchedule:
    """The plan's cached schedule for ``block_m``."""
    return plan.cached(("triton.tiles", block_m, lpt), lambda: build_schedule(plan, block_m, lpt))
