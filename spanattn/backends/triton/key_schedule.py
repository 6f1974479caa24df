"""The dK/dV pass's schedule: for each key tile (``block_n`` keys of one sequence), the query
tiles its program walks, longest walks first.

Read by columns, the mask gives each key one interval of the chunk's queries
(``intervals.column_intervals``, ``Plan.columns``), so a key tile's queries lie in the hull
``[min qlo, max qhi]`` of its keys' columns, and the query tiles inside every key's column
(``[max qlo, min qhi]``) need no mask: the transpose of the forward's walk (schedule.py). Span
groups add each group's queries outside the hull, walked over ``groups.query_tile_runs``.

The definition in torch ops, no per-token Python loop (tile starts from host lists:
``schedule.tile_starts``); built once per plan and block shape and cached on the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...intervals import seq_ids
from .columns import KEY_INFO
from .schedule import device_tile_starts, tile_starts

BIG = 2**31 - 1


@dataclass(frozen=True)
class KeySchedule:
    """``info``: int32 ``[num_tiles, len(KEY_INFO)]`` (columns.KEY_INFO) in launch order,
    heaviest first: the key tile's sequence (first packed key row, keys, first packed query
    row, queries), its first key in the sequence, and its query walk for ``block_m``-query
    tiles in the chunk's query indices: ``[q_start, q_end)``, the FULL tiles in ``[full_start,
    full_end)`` (multiples of ``block_m`` but ``q_end``; all 0 for a tile no query sees through
    the intervals). ``tile_cost``: queries walked (the hull, widened to the queries of the
    tile's keys' span groups)."""

    block_m: int
    block_n: int
    info: torch.Tensor
    tile_cost: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.info.shape[0]

    def column(self, name: str) -> torch.Tensor:
        return self.info[:, KEY_INFO.index(name)]


def build_key_schedule(plan, block_m: int, block_n: int, lpt: bool = True, out=None) -> KeySchedule:
    """Every sequence's keys in tiles of ``block_n``, each with its column hull and FULL query
    tiles, ordered longest walk first (``lpt``) or in sequence order. A device plan's is built
    on the device (capturable), capacity-sized: its tiles past the step's hold no key
    (``n_start = kv_len = 1``, an empty walk: the kernel reads key row 0 and stores nothing);
    ``out``: its schedule of an earlier step, rewritten in place (a captured graph reads it)."""
    dev, n = plan.device, plan.num_seqs
    if plan.capacity is None:
        starts = tile_starts([s.kv_len for s in plan.batch.seqs], block_n)
        tile_seq, n_start = (t.to(dev) for t in starts)
        first_tile, live = torch.searchsorted(tile_seq, torch.arange(n, device=dev)), None
    else:
        tile_seq, n_start, first_tile, live = device_tile_starts(plan.cu_seqlens_k, plan.total_k, block_n)
    total = tile_seq.shape[0]
    cu_q, cu_k = plan.cu_seqlens_q.long(), plan.cu_seqlens_k.long()
    qlo, qhi = (t.long() for t in plan.columns())
    key_seq = seq_ids(plan.cu_seqlens_k, plan.total_k)
    live_key = key_seq < n  # a device plan's keys past the step's: reduced into a slot dropped after
    key_seq = key_seq.clamp_max(n - 1)
    key_tile = first_tile[key_seq] + (torch.arange(plan.total_k, device=dev) - cu_k[key_seq]) // block_n
    key_tile = torch.where(live_key, key_tile, total)

    def reduce(values, how, init):
        out = torch.full((total + 1,), init, dtype=torch.int64, device=dev)
        return out.scatter_reduce(0, key_tile, values, how)[:total]

    # The hull counts keys some query sees; the FULL range every key of the tile (a key no query
    # sees, a cached key behind every window, leaves it empty: its qlo > qhi).
    seen = qlo <= qhi
    hull_lo, hull_hi = (
        reduce(torch.where(seen, qlo, BIG), "amin", BIG),
        reduce(torch.where(seen, qhi, -1), "amax", -1),
    )
    lo_max, hi_min = reduce(qlo, "amax", -1), reduce(qhi, "amin", BIG)
    walks = hull_hi >= 0
    q_start = torch.where(walks, hull_lo // block_m * block_m, 0)
    q_end = torch.where(walks, hull_hi + 1, 0)
    full_start = torch.minimum((lo_max + block_m - 1) // block_m * block_m, q_end)
    full_end = torch.maximum(torch.minimum((hi_min + 1) // block_m * block_m, q_end), full_start)
    cols = {
        "k_row0": cu_k[tile_seq],
        "kv_len": cu_k[tile_seq + 1] - cu_k[tile_seq],
        "n_start": n_start,
        "q_row0": cu_q[tile_seq],
        "q_len": cu_q[tile_seq + 1] - cu_q[tile_seq],
        "q_start": q_start,
        "q_end": q_end,
        "full_start": full_start,
        "full_end": full_end,
    }
    if live is not None:  # tiles past the step's: key 1 of a one-key sequence at row 0, no walk
        empty = {"k_row0": 0, "kv_len": 1, "n_start": 1, "q_row0": 0, "q_len": 0}
        cols |= {c: torch.where(live, cols[c], value) for c, value in empty.items()}
    info = torch.stack([cols[c] for c in KEY_INFO], 1).to(torch.int32)
    first, last = torch.where(walks, q_start, BIG), torch.where(walks, q_end, -1)
    g = plan.groups
    if g is not None:  # the walk reaches the queries of its keys' groups as well
        index, runs = (t.long() for t in query_group_args(plan, block_m)[2:])
        has = index[:, 0] < index[:, 1]
        g_first = torch.where(has, runs[index[:, 0].clamp_max(len(runs) - 1), 0], BIG)
        g_last = torch.where(has, runs[(index[:, 1] - 1).clamp_min(0), 1], -1)
        kg = g.k_group.long()
        grouped = kg >= 0
        first = torch.minimum(first, reduce(torch.where(grouped, g_first[kg.clamp_min(0)], BIG), "amin", BIG))
        last = torch.maximum(last, reduce(torch.where(grouped, g_last[kg.clamp_min(0)], -1), "amax", -1))
    cost = (last - first).clamp_min(0).to(torch.int32)
    if lpt:
        order = torch.argsort(cost, descending=True, stable=True)
        info, cost = info[order], cost[order]
    if out is not None:
        out.info.copy_(info)
        out.tile_cost.copy_(cost)
        return out
    return KeySchedule(block_m, block_n, info.contiguous(), cost.contiguous())


def key_schedule(plan, block_m: int, block_n: int, lpt: bool = True) -> KeySchedule:
    """The plan's cached dK/dV schedule for ``block_m x block_n`` tiles (built by a step's first
    backward layer, reused by the others)."""
    return plan.cached(("triton.key_tiles", block_m, block_n, lpt), lambda: build_key_schedule(
        plan, block_m, block_n, lpt))  # fmt: skip


def query_group_args(plan, block_m: int) -> tuple:
    """The dK/dV kernel's span group tensors: query groups, key groups, where each group's
    query-tile runs are and the runs (``groups.query_tile_runs`` for ``block_m``-query tiles,
    cached on the plan). A plan without groups passes its ``lo`` four times, as
    ``group_args`` does: the kernel compiled with ``GROUPS=False`` never reads them."""
    g = plan.groups
    if g is None:
        return (plan.lo,) * 4
    from ...groups import query_tile_runs

    runs, index = plan.cached(
        ("triton.query_runs", block_m),
        lambda: query_tile_runs(g, plan.cu_seqlens_q, plan.cu_seqlens_k, block_m),
    )
    return g.q_group, g.k_group, index, runs
