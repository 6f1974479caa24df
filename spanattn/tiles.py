"""Tile tables: which KV blocks each query block visits, and which of them need no mask.

The whole step is seen as ONE packed sequence of ``total_q`` queries by ``total_k`` keys, the
layout FlexAttention's ``BlockMask`` describes: query ``r`` of sequence ``i`` may see packed keys
``[lo[r] + cu_seqlens_k[i], hi[r] + cu_seqlens_k[i]]``. Query blocks may straddle sequences (a
decode batch puts many sequences in one block), so a block's KV blocks need not be one range;
the tables are built on a grid of blocks instead, never on pairs:

- a row touches KV blocks ``[alo // BLOCK_N, ahi // BLOCK_N]``;
- a row covers KV blocks ``[ceil(alo / BLOCK_N), (ahi + 1) // BLOCK_N - 1]`` entirely;
- per query block, difference arrays over those ranges count the rows touching / covering each
  KV block: FULL when all ``BLOCK_M`` rows cover it, PARTIAL when touched but not FULL.

Blocks hanging over the end (``total_q`` or ``total_k`` not a multiple of the block) count their
missing rows/columns as masked, as ``create_block_mask`` does, so they are never FULL and the
kernel's ``mask_mod`` runs on them. Span groups (groups.py) add, for each query row of a group,
the KV blocks holding keys of its group (counted exactly, so FULL and PARTIAL stay exact), and
nothing else. Tables use flex's names and conventions: ``kv_num_blocks`` and
``kv_indices`` list the PARTIAL blocks, ``full_kv_*`` the FULL ones; each index row holds the
listed blocks in ascending order followed by the other blocks, ascending.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .groups import SpanGroups
from .plan import Plan


@dataclass(frozen=True)
class TileTables:
    """Block-sparse tables of one step; int32, rows are query blocks."""

    kv_num_blocks: torch.Tensor  # [num_q_blocks] partial blocks per query block
    kv_indices: torch.Tensor  # [num_q_blocks, num_kv_blocks]
    full_kv_num_blocks: torch.Tensor  # [num_q_blocks] full blocks per query block
    full_kv_indices: torch.Tensor  # [num_q_blocks, num_kv_blocks]
    BLOCK_M: int
    BLOCK_N: int
    q_len: int  # packed lengths the tables were built for
    kv_len: int

    def visited_blocks(self) -> int:
        """KV blocks the kernel loads over all query blocks (partial + full)."""
        return int(self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum())


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean block grid -> (count per row, indices: the set blocks first, both parts ascending)."""
    grid = blocks.to(torch.int32)
    num = grid.sum(dim=-1, dtype=torch.int32)
    # A stable descending sort of 0/1 keeps ascending order inside both groups.
    indices = torch.argsort(grid, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, indices


def _count_rows(starts, ends, weight, row_block, num_q_blocks, num_kv_blocks):
    """Rows per (query block, KV block) whose range ``[start, end]`` includes that KV block.

    Difference array: +weight at ``start``, -weight at ``end + 1``, prefix sum along KV blocks.
    """
    width = num_kv_blocks + 1
    diff = torch.zeros(num_q_blocks * width, dtype=torch.int32, device=starts.device)
    base = row_block * width
    diff.index_add_(0, base + starts, weight)
    diff.index_add_(0, base + ends + 1, -weight)
    return diff.view(num_q_blocks, width).cumsum(dim=1, dtype=torch.int32)[:, :num_kv_blocks]


def _group_rows(groups: SpanGroups, alo, ahi, kv_len, BLOCK_M, BLOCK_N, touching, covering) -> None:
    """Add the rows of span groups to ``touching`` and ``covering`` (in place): for each such row
    and each KV block of its hull (interval and group), the allowed keys it has there, counted
    exactly (interval overlap + group keys outside the interval: ``SpanGroups.outside``).
    Consecutive rows of one query block with the same group and interval count alike, so each
    such run is counted once, weighted by its rows (a video frame's rows in a global layer share
    one interval). O(runs x blocks of their hulls)."""
    rows = (groups.q_group >= 0).nonzero().flatten()
    if not rows.numel():
        return
    kind = torch.stack([rows // BLOCK_M, groups.q_group[rows].long(), alo[rows], ahi[rows]], 1)
    first = torch.ones(len(kind), dtype=torch.bool, device=kind.device)
    first[1:] = (kind[1:] != kind[:-1]).any(1)
    starts = first.nonzero().flatten()
    weight = torch.diff(starts, append=starts.new_tensor([len(kind)]))
    block, g, lo, hi = (c.contiguous() for c in kind[starts].unbind(1))
    ext = groups.extents.long()[g]
    nb0 = torch.minimum(lo, ext[:, 0]) // BLOCK_N
    nb1 = torch.maximum(hi, ext[:, 1]) // BLOCK_N
    width = int((nb1 - nb0).max()) + 1  # one host read: the widest hull
    n = nb0[:, None] + torch.arange(width, device=rows.device)[None, :]
    valid = n <= nb1[:, None]
    b0 = n * BLOCK_N
    b1 = torch.minimum(b0 + BLOCK_N - 1, torch.full_like(b0, kv_len - 1))
    lo, hi, g = lo[:, None], hi[:, None], g[:, None].expand_as(n)
    inter = (torch.minimum(b1, hi) - torch.maximum(b0, lo) + 1).clamp_min(0)
    count = inter + groups.outside(g, lo.expand_as(n), hi.expand_as(n), b0, b1)
    cell = (block[:, None].expand_as(n)[valid], n[valid])
    weight = weight.to(torch.int32)[:, None]
    touching.index_put_(cell, ((count > 0).to(torch.int32) * weight)[valid], accumulate=True)
    covering.index_put_(cell, ((count == BLOCK_N).to(torch.int32) * weight)[valid], accumulate=True)


def build_tile_tables(
    alo, ahi, kv_len: int, BLOCK_M: int = 128, BLOCK_N: int = 128, groups: SpanGroups | None = None
) -> TileTables:
    """Tables for packed intervals ``alo, ahi`` (int ``[q_len]``, inclusive) over ``kv_len`` keys,
    and the span groups' part of the mask in the same rows (``groups``, if any).

    Vectorized: O(q_len) scatter plus O(blocks) prefix sums and one sort per block row (plus,
    with groups, O(blocks) per row of a group).
    """
    q_len = alo.shape[0]
    num_q_blocks = -(-q_len // BLOCK_M)
    num_kv_blocks = -(-kv_len // BLOCK_N)
    alo, ahi = alo.long(), ahi.long()
    row_block = torch.arange(q_len, device=alo.device) // BLOCK_M
    ones = torch.ones(q_len, dtype=torch.int32, device=alo.device)

    touching = _count_rows(alo // BLOCK_N, ahi // BLOCK_N, ones, row_block, num_q_blocks, num_kv_blocks)
    first = (alo + BLOCK_N - 1) // BLOCK_N
    last = (ahi + 1) // BLOCK_N - 1
    # Rows that cover no whole block add nothing; their (last + 1) may precede first, harmlessly.
    # A row of a span group counts its covers with its group keys (_group_rows) instead.
    covers = first <= last
    if groups is not None:
        covers &= groups.q_group < 0
    covering = _count_rows(first, last, covers.to(torch.int32), row_block, num_q_blocks, num_kv_blocks)
    if groups is not None:
        _group_rows(groups, alo, ahi, kv_len, BLOCK_M, BLOCK_N, touching, covering)
    full = covering == BLOCK_M  # a short last query block never reaches BLOCK_M
    partial = (touching > 0) & ~full

    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return TileTables(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_M, BLOCK_N, q_len, kv_len
    )


def tile_tables(plan: Plan, BLOCK_M: int = 128, BLOCK_N: int = 128, fused: bool | None = None) -> TileTables:
    """The plan's packed tile tables, built once per plan and block shape.

    fused: one Triton launch that also writes the packed intervals (tiles_triton.py); default
        on CUDA when triton is installed (planning there is bound by kernel launches). Otherwise,
        and for plans with span groups (the fused builder reads intervals only), the torch code
        above.
    """

    def build():
        use_triton = plan.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        if (fused if fused is not None else use_triton) and plan.groups is None:
            from .tiles_triton import fused_tile_tables

            packed, tables = fused_tile_tables(plan, BLOCK_M, BLOCK_N)
            plan.cached("packed_intervals", lambda: packed)  # what plan.packed_intervals() builds
            return TileTables(*tables, BLOCK_M, BLOCK_N, plan.total_q, plan.total_k)
        alo, ahi = plan.packed_intervals()
        return build_tile_tables(alo, ahi, plan.total_k, BLOCK_M, BLOCK_N, plan.groups)

    return plan.cached(("tile_tables", BLOCK_M, BLOCK_N), build)
