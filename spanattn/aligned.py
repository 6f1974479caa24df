"""A packing in which every sequence owns whole tiles, for backends that see the step as ONE
packed sequence on a fixed tile grid (FlexAttention, FA4's sparse path).

Why: such a kernel multiplies the probabilities of a tile by every value row the tile holds. A
key of another sequence gets probability 0, but ``0 * NaN`` and ``0 * Inf`` are NaN, so a tile
that straddles two sequences lets one request's overflow reach its neighbour (and a query tile
that straddles two sequences visits the other's key tiles too). In this layout sequence ``i``'s
queries start on a multiple of ``BLOCK_M`` and its keys on a multiple of ``BLOCK_N``; the rows in
between are zeros, so no tile ever holds two sequences. Where the packed layout already does
(one sequence, or every sequence but the last a whole number of tiles long) nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .groups import SpanGroups
from .intervals import seq_ids
from .plan import Plan


@dataclass(frozen=True)
class Rows:
    """One side (queries or keys) of an aligned layout."""

    rows: torch.Tensor | None  # int64 [packed rows]: aligned row of each; None: packed is aligned
    starts: torch.Tensor  # int64 [num_seqs]: each sequence's first aligned row
    num: int  # rows of the aligned layout
    gaps: torch.Tensor | None  # int64: aligned rows that hold no packed row (zeroed)


@dataclass(frozen=True)
class AlignedLayout:
    """Where each packed row goes, and the step's intervals in the aligned rows."""

    q: Rows
    k: Rows
    lo: torch.Tensor  # int32 [q.num]: allowed keys in aligned key rows; rows holding no query
    hi: torch.Tensor  #   have (0, -1), an interval that touches no key and no tile
    groups: SpanGroups | None = None  # the plan's span groups in the aligned rows (gaps: none)

    @property
    def copies(self) -> bool:
        return self.q.rows is not None or self.k.rows is not None


def aligned(lengths: list[int], block: int) -> bool:
    """Does every sequence but the last start on a multiple of ``block`` when packed?"""
    return all(n % block == 0 for n in lengths[:-1])


def padded_rows(plan: Plan, side: str, block: int) -> Rows:
    """The aligned rows of ``side`` ("q" or "k") for tiles of ``block`` rows, cached on the plan.
    Lengths come from the host-side batch; the row maps are built on the device, no sync."""

    def build():
        cu = (plan.cu_seqlens_q if side == "q" else plan.cu_seqlens_k).long()
        lengths = [s.q_len if side == "q" else s.kv_len for s in plan.batch.seqs]
        total = sum(lengths)
        if aligned(lengths, block):
            return Rows(None, cu[:-1], total, None)
        padded = [-(-n // block) * block for n in lengths]
        host_starts = [0]
        for n in padded[:-1]:
            host_starts.append(host_starts[-1] + n)
        gaps = [r for s, n, m in zip(host_starts, lengths, padded) for r in range(s + n, s + m)]
        starts = torch.tensor(host_starts, device=cu.device)
        seq = plan.query_seq_ids() if side == "q" else seq_ids(plan.cu_seqlens_k, total)
        rows = starts[seq] + torch.arange(total, device=cu.device) - cu[seq]
        return Rows(rows, starts, sum(padded), torch.tensor(gaps, dtype=torch.int64, device=cu.device))

    return plan.cached(("padded_rows", side, block), build)


def aligned_layout(plan: Plan, block_m: int, block_n: int) -> AlignedLayout:
    """The plan's aligned layout for ``block_m x block_n`` tiles (built once per plan)."""

    def build():
        q, k = padded_rows(plan, "q", block_m), padded_rows(plan, "k", block_n)
        alo, ahi = plan.packed_intervals()
        if q.rows is None and k.rows is None:
            return AlignedLayout(q, k, alo, ahi, plan.groups)
        k_shift = k.starts - plan.cu_seqlens_k[:-1].long()
        shift = k_shift[plan.query_seq_ids()].to(torch.int32)
        lo = torch.zeros(q.num, dtype=torch.int32, device=alo.device)
        hi = torch.full((q.num,), -1, dtype=torch.int32, device=alo.device)
        rows = slice(None) if q.rows is None else q.rows
        lo[rows], hi[rows] = alo + shift, ahi + shift
        groups = plan.groups
        if groups is not None:
            key_shift = lambda r: k_shift[torch.searchsorted(plan.cu_seqlens_k[1:].long(), r, right=True)]
            groups = groups.moved(q.rows, q.num, k.rows, k.num, key_shift)
        return AlignedLayout(q, k, lo, hi, groups)

    return plan.cached(("aligned_layout", block_m, block_n), build)


def scatter_rows(x: torch.Tensor, side: Rows, plan: Plan | None = None, name: str = "") -> torch.Tensor:
    """``x``'s rows at their aligned rows, zeros in the gaps (``x`` itself where nothing moves).
    Without ``plan``, a new tensor: one pass over ``x``, the gaps written apart. With it, a buffer
    kept on the plan under ``name`` ("q", "k", "v"), zeroed once (every call writes the same rows,
    so the gaps stay zero): one op per call where a new tensor costs three, on every layer of the
    step. Like the triton backend's page copies, it assumes a plan's calls run in one stream's
    order (the next call's copy lands after the previous call's kernel read the buffer)."""
    if side.rows is None:
        return x
    if plan is None:
        out = x.new_empty(side.num, *x.shape[1:]).index_copy_(0, side.rows, x)
        return out.index_fill_(0, side.gaps, 0)
    key = ("aligned_rows", name, id(side), x.dtype, x.device, tuple(x.shape[1:]))
    buffer = plan.cached(key, lambda: x.new_zeros(side.num, *x.shape[1:]))
    return buffer.index_copy_(0, side.rows, x)


def aligned_tile_tables(plan: Plan, block_m: int, block_n: int):
    """Tile tables over the aligned layout (the plan's packed tables where nothing moves)."""
    from .tiles import build_tile_tables, tile_tables

    layout = aligned_layout(plan, block_m, block_n)
    if not layout.copies:
        return tile_tables(plan, block_m, block_n)
    return plan.cached(
        ("aligned_tile_tables", block_m, block_n),
        lambda: build_tile_tables(layout.lo, layout.hi, layout.k.num, block_m, block_n, layout.groups),
    )
