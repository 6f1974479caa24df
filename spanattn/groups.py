"""Span groups: the part of a step's mask beyond each query's interval (docs/design.md section 2).

A query inside a span of group ``g`` also sees every key inside the group's other spans; in
``clamp`` mode only keys within its past window. The interval ``[lo, hi]`` of intervals.py stays
what it was (base + own span); the group part needs O(tokens) more:

    allowed(q, k) = lo[q] <= k <= hi[q]  or  (g_q >= 0 and g_k == g_q and (mode != clamp or k >= lo[q]))

``g_q``, ``g_k``: the step-wide group id of the query's and the key's span (-1 outside every
grouped span). In clamp mode ``lo[q]`` is the base interval's lower end, ``q - W + 1`` (or 0),
for rows inside spans too, so ``k >= lo[q]`` is the window test without the query's position
(the inclusive non-causal window's extra key ``q - W`` lies in ``[lo, hi]`` already). Ids are
unique across the step's sequences, so a packed mask (flex) needs no sequence test either.

>>> import spanattn as sa
>>> p = sa.plan(sa.Batch([sa.Seq(q_len=8, spans=[(1, 2, 0), (5, 6, 0)])]), sa.LayerMask())
>>> p.groups.q_group.tolist(), p.groups.k_group.tolist()
([-1, 0, 0, -1, -1, 0, 0, -1], [-1, 0, 0, -1, -1, 0, 0, -1])
>>> p.to_dense(0)[1].int().tolist()  # query 1 (first image) sees the second image too
[1, 1, 1, 0, 0, 1, 1, 0]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from .intervals import fuses, seq_ids, span_holding

BIG = 2**32  # (group, position) as one int64 key: positions fit int32


@dataclass(frozen=True)
class SpanGroups:
    """The group part of a step's mask, in packed rows (or any layout's rows: see ``moved``).

    q_group: int32 ``[query rows]``, the step-wide group of each query (-1: none).
    k_group: int32 ``[key rows]``, the group of each key (-1: none).
    spans: int32 ``[m, 3]`` rows of (group, first key row, last key row) of every grouped span,
        ordered by group then start; ends capped at the sequence's last key.
    clamp: the layer's span mode is clamp (group keys below a row's ``lo`` are not allowed).
    num_groups: groups in the step (ids ``0..num_groups - 1``).
    """

    q_group: torch.Tensor
    k_group: torch.Tensor
    spans: torch.Tensor
    clamp: bool
    num_groups: int

    @cached_property
    def extents(self) -> torch.Tensor:
        """int32 ``[num_groups, 2]``: each group's first and last key row."""
        g, s, e = self.spans.long().unbind(1)
        full = lambda v: torch.full((self.num_groups,), v, dtype=torch.int64, device=s.device)
        first, last = (
            full(2**31 - 1).scatter_reduce(0, g, s, "amin"),
            full(-1).scatter_reduce(0, g, e, "amax"),
        )
        return torch.stack([first, last], 1).to(torch.int32)

    def keys_before(self, group: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """int64: how many keys of ``group`` lie at rows ``< x`` (tensors of one shape; ``group``
        >= 0). Binary search over the spans and their running lengths: O(log m) each."""
        g, s, e = self.spans.long().unbind(1)
        length = e - s + 1
        ran = torch.cumsum(length, 0) - length  # keys of all spans before each one
        key = g * BIG + s
        j = (torch.searchsorted(key, group * BIG + x - 1, right=True) - 1).clamp_min(0)
        first = torch.searchsorted(key, group * BIG).clamp_max(len(key) - 1)
        same = g[j] == group
        inside = (x - s[j]).clamp(0, None).minimum(length[j])
        return torch.where(same & (j >= first), ran[j] - ran[first] + inside, 0)

    def keys_in(self, group, a, b) -> torch.Tensor:
        """Keys of ``group`` at rows ``a..b`` inclusive (0 where ``a > b``)."""
        return (self.keys_before(group, b + 1) - self.keys_before(group, a)).clamp_min(0)

    def outside(self, group, alo, ahi, a, b) -> torch.Tensor:
        """Keys at rows ``a..b`` that the group part allows a row of ``group`` with interval
        ``[alo, ahi]`` beyond it: group keys above ``ahi``, and below ``alo`` unless clamp."""
        n = self.keys_in(group, torch.maximum(a, ahi + 1), b)
        if not self.clamp:
            n = n + self.keys_in(group, a, torch.minimum(b, alo - 1))
        return n

    def extra_pairs(self, alo: torch.Tensor, ahi: torch.Tensor) -> int:
        """Allowed (query, key) pairs beyond the intervals ``[alo, ahi]`` (in this layout's rows)."""
        rows = (self.q_group >= 0).nonzero().flatten()
        if not rows.numel():
            return 0
        g = self.q_group[rows].long()
        ext = self.extents.long()
        lo, hi = alo[rows].long(), ahi[rows].long()
        return int(self.outside(g, lo, hi, ext[g, 0], ext[g, 1]).sum())

    def dense(self, q_rows: slice, k_rows: slice, lo: torch.Tensor) -> torch.Tensor:
        """Bool ``[q rows, k rows]``: the group part for one sequence's rows, ``lo`` its rows'
        interval starts (any key origin: only compared with positions counted from ``k_rows``)."""
        gq, gk = self.q_group[q_rows].long()[:, None], self.k_group[k_rows].long()[None, :]
        allowed = (gq >= 0) & (gq == gk)
        if self.clamp:
            allowed &= torch.arange(gk.shape[1], device=gk.device)[None, :] >= lo[:, None]
        return allowed

    def sequence(self, q_rows: slice, k_rows: slice) -> SpanGroups:
        """The groups of one sequence, rows counted from its first query and key."""
        keep = (self.spans[:, 1] >= k_rows.start) & (self.spans[:, 2] < k_rows.stop)
        spans = self.spans[keep] - torch.tensor([0, k_rows.start, k_rows.start], dtype=torch.int32,
                                                device=self.spans.device)  # fmt: skip
        return replace(self, q_group=self.q_group[q_rows], k_group=self.k_group[k_rows], spans=spans)

    def moved(self, q_rows, q_num: int, k_rows, k_num: int, k_shift_of_row) -> SpanGroups:
        """The groups in another layout of the same rows (aligned.py): ``q_rows``/``k_rows`` the
        new row of each packed row (None: unchanged), ``*_num`` the layout's row counts (rows
        holding no packed row get group -1), ``k_shift_of_row(rows)`` the shift of packed key
        rows into it."""

        def scatter(x, rows, num):
            if rows is None:
                return x
            return torch.full((num,), -1, dtype=x.dtype, device=x.device).index_copy_(0, rows, x)

        shift = k_shift_of_row(self.spans[:, 1].long()).to(torch.int32)
        spans = self.spans.clone()
        spans[:, 1:] += shift[:, None]
        return replace(
            self, q_group=scatter(self.q_group, q_rows, q_num), k_group=scatter(self.k_group, k_rows, k_num),
            spans=spans,
        )  # fmt: skip


def span_groups(
    layer, step: dict, total_q: int, total_k: int, fused: bool | None = None
) -> SpanGroups | None:
    """The step's :class:`SpanGroups` from :func:`intervals.step_tensors`' tensors, or None when
    it has no group (then plans carry nothing more than intervals).

    The span table and the extents come from the host in step_tensors' copy (group_tables.py);
    the ids take one launch with ``fused`` (groups_triton.py; default on CUDA, as for
    ``compute_intervals``), else :func:`group_ids_torch`, the definition. Neither syncs."""
    if layer.spans == "off" or "span_group" not in step:
        return None
    if fused is None:
        fused = fuses(step)
    if fused:
        from .groups_triton import group_ids_triton

        q_group, k_group = group_ids_triton(step, total_q, total_k)
    else:
        q_group, k_group = group_ids_torch(step, total_q, total_k)
    groups = SpanGroups(q_group, k_group, step["group_spans"], layer.spans == "clamp", step["num_groups"])
    # the cached property's value, known on the host (a copy made by ``replace`` computes its own)
    object.__setattr__(groups, "extents", step["group_extents"])
    return groups


def group_ids_torch(step: dict, total_q: int, total_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_group, k_group``: int32 ``[total_q]``, ``[total_k]``, the ``span_group`` of the span
    holding each packed query and key (positions as intervals.py counts them), -1 outside spans."""
    spans, group = step["spans"], step["span_group"].long()
    cu_q, cu_k, kv_len = step["cu_seqlens_q"].long(), step["cu_seqlens_k"].long(), step["kv_len"].long()

    def group_of(cu, total, pos_from_row):
        seq = seq_ids(cu, total)
        j, inside, _, _ = span_holding(spans, seq, pos_from_row(seq))
        return torch.where(inside, group.index_select(0, j), -1).to(torch.int32)

    rows_q = torch.arange(total_q, device=cu_q.device)
    rows_k = torch.arange(total_k, device=cu_k.device)
    q_group = group_of(cu_q, total_q, lambda seq: rows_q + (kv_len - cu_q[1:])[seq])
    k_group = group_of(cu_k, total_k, lambda seq: rows_k - cu_k[seq])
    return q_group, k_group


def tile_runs(
    groups: SpanGroups, cu_seqlens_k: torch.Tensor, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a kernel walking ``block_n``-key tiles finds each group's keys: ``runs`` int32
    ``[m, 2]``, the ``[start, end)`` key positions (in the group's sequence; starts on a tile
    edge) of maximal runs of consecutive tiles that hold a span of one group, and ``index`` int32
    ``[num_groups, 2]``, the rows ``[first, end)`` of ``runs`` that belong to each group. Video
    frames with a few text tokens between them make ONE run; images far apart make one each.
    Rows of ``runs`` past the last run are unused."""
    g, s, e = (c.contiguous() for c in groups.spans.long().unbind(1))
    base = cu_seqlens_k.long()[torch.searchsorted(cu_seqlens_k[1:].long(), s, right=True)]
    return _runs(g, s - base, e - base, torch.ones_like(g, dtype=torch.bool), block_n, groups.num_groups)


def query_tile_runs(
    groups: SpanGroups, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tile_runs`` read by queries: where a kernel walking ``block_m``-query tiles (a backward
    pass's dK/dV programs, each holding a key tile) finds each group's queries. ``runs`` int32
    ``[m, 2]``: ``[start, end)`` query indices local to the group's sequence's chunk (``0 ..
    q_len - 1``; starts on a tile edge) of maximal runs of consecutive query tiles holding a
    query of one group; ``index`` int32 ``[num_groups, 2]`` as in ``tile_runs``. A span holds
    the chunk's queries at its positions ``ctx ..`` (``ctx = kv_len - q_len``); spans wholly in
    the cache hold none and make no run (a group without queries in the step has ``first >=
    end``)."""
    g, s, e = (c.contiguous() for c in groups.spans.long().unbind(1))
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    seq = torch.searchsorted(cu_k[1:], s, right=True)
    first_query = cu_k[seq] + (cu_k.diff() - cu_q.diff())[seq]  # the packed key row of query 0
    first, last = (s - first_query).clamp_min(0), e - first_query
    return _runs(g, first, last, last >= 0, block_m, groups.num_groups)


def _runs(g, first, last, keep, block: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tile_runs``' tables from span pieces: group ``g``, positions ``first .. last`` in the
    group's sequence (int64 ``[m]`` each, ordered by group then position), only pieces with
    ``keep``. A kept piece starts a new run unless the previous KEPT piece is of its group and
    ends in its first tile or the one before; pieces left out take no part in any run."""
    m = len(g)
    first_tile, last_tile = first // block, last // block
    # the previous kept piece of each piece (-1: none), found without a Python loop
    kept_at = torch.where(keep, torch.arange(m, device=g.device), -1)
    prev = torch.cat([kept_at.new_full((1,), -1), torch.cummax(kept_at, 0).values[:-1]])
    prev_c = prev.clamp_min(0)
    prev_last = torch.where(prev >= 0, last_tile[prev_c], -2)
    prev_group = torch.where(prev >= 0, g[prev_c], -1)
    new = keep & ((g != prev_group) | (first_tile > prev_last + 1))  # not next to its group's last tile
    run = (torch.cumsum(new.long(), 0) - 1).clamp_min(0)  # left-out pieces scatter neutral values
    full = lambda size, v: torch.full((size,), v, dtype=torch.int64, device=g.device)
    big = 2**31 - 1
    runs = torch.stack(
        [full(m, big).scatter_reduce(0, run, torch.where(keep, first_tile * block, big), "amin"),
         full(m, -1).scatter_reduce(0, run, torch.where(keep, last + 1, -1), "amax")], 1,
    )  # fmt: skip
    index = torch.stack(
        [full(num_groups, m).scatter_reduce(0, g, torch.where(keep, run, m), "amin"),
         full(num_groups, 0).scatter_reduce(0, g, torch.where(keep, run + 1, 0), "amax")], 1,
    )  # fmt: skip
    return runs.to(torch.int32), index.to(torch.int32)
