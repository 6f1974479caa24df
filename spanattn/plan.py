"""Plan: a step's intervals plus the packing every backend needs. Built once per step and
layer kind, reused by every layer of that kind."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from .arguments import device as check_device
from .groups import SpanGroups, span_groups
from .intervals import column_intervals, compute_intervals, dense_from_intervals, seq_ids, step_tensors
from .spec import Batch, LayerMask

_SERIALS = itertools.count(1)
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass(eq=False)
class Plan:
    """The mask of one step as intervals, packed like flash-attention's varlen API.

    lo, hi: int32 ``[total_q]``, inclusive key positions local to each query's sequence.
    cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]`` offsets into packed q and k/v.
    seq_lens: int32 ``[num_seqs]`` keys per sequence (``seqused_k`` for a paged cache).
    groups: the span groups' part of the mask (groups.py), None when the step has none (then the
        intervals are the whole mask).
    handle: int64 ``[1]`` on the CPU naming this plan (``Plan._from_handle``): how the torch ops
        (ops.py) reach the plan's host-side facts and cached tables without a device sync.

    Users read the fields above, ``total_q``, ``total_k``, ``num_seqs``, and ``describe()``,
    ``to_dense(i)``, ``allowed_pairs()``, ``density()``. The other methods (``cached``,
    ``columns``, ``packed_intervals``, ``query_seq_ids``, ``host_layout``, ``seq_slice``,
    ``dense_rows``) serve the backends: tables derived from the plan, built once and cached on it.
    """

    batch: Batch
    layer: LayerMask
    lo: torch.Tensor
    hi: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens: torch.Tensor
    groups: SpanGroups | None = None
    _cache: dict = field(default_factory=dict, repr=False)
    # Lengths here are exact and known on the host; a device plan (device_planner.py) has a
    # Capacity instead, and its lengths are bounds.
    capacity = None

    def __post_init__(self):
        serial = next(_SERIALS)
        self.handle = torch.tensor([serial], dtype=torch.int64)
        _LIVE[serial] = self

    @staticmethod
    def _from_handle(handle: torch.Tensor) -> Plan:
        """The live plan a ``handle`` names (the torch ops' way back to it)."""
        plan = _LIVE.get(int(handle[0]))
        if plan is None:
            raise RuntimeError("spanattn: the plan this op was called with no longer exists")
        return plan

    @property
    def device(self) -> torch.device:
        return self.lo.device

    @property
    def num_seqs(self) -> int:
        return len(self.batch)

    # Host-side facts, computed once: backends read them on every call (O(num_seqs) each).
    @cached_property
    def total_q(self) -> int:
        return self.batch.total_q

    @cached_property
    def total_k(self) -> int:
        return self.batch.total_k

    @cached_property
    def max_seqlen_q(self) -> int:
        return max(s.q_len for s in self.batch.seqs)

    @cached_property
    def max_seqlen_k(self) -> int:
        return max(s.kv_len for s in self.batch.seqs)

    @cached_property
    def min_seqlen_k(self) -> int:
        """The shortest sequence's keys (kernels reading whole key tiles need one tile)."""
        return min(s.kv_len for s in self.batch.seqs)

    @cached_property
    def _facts(self) -> dict:
        """What calls on the plan keep for later calls: dispatch.py's checked call shapes, the triton
        backend's routes, the block table checked last (page_check.py)."""
        return {}

    def host_layout(self) -> list[tuple[int, int, int, int, int]]:
        """``(i, q_start, q_end, k_start, kv_len)`` of every sequence, in packed rows (cached)."""

        def build():
            rows, q0, k0 = [], 0, 0
            for i, s in enumerate(self.batch.seqs):
                rows.append((i, q0, q0 + s.q_len, k0, s.kv_len))
                q0, k0 = q0 + s.q_len, k0 + s.kv_len
            return rows

        return self.cached("host_layout", build)

    def cached(self, key, build: Callable[[], Any]):
        """Derived tables (tile lists, block masks) are built once per plan and kept here."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def packed_intervals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lo, hi`` moved into packed key coordinates (int32 ``[total_q]``), cached.

        With these a mask over the packed batch is two compares, ``alo[q] <= kv <= ahi[q]``: every
        interval lies inside its own sequence's keys, so no sequence-id check is needed.
        """

        def build():
            offset = self.cu_seqlens_k[:-1][self.query_seq_ids()]
            return (self.lo + offset).to(torch.int32), (self.hi + offset).to(torch.int32)

        return self.cached("packed_intervals", build)

    def query_seq_ids(self) -> torch.Tensor:
        """int64 ``[total_q]``: the sequence of each packed query (cached)."""
        return self.cached("query_seq_ids", lambda: seq_ids(self.cu_seqlens_q, self.total_q))

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``qlo, qhi``: int32 ``[total_k]``, the chunk's queries that see each packed key through
        the intervals (``intervals.column_intervals``; span groups add their own part), built on
        first use (a backward pass) and cached."""

        def build():
            return column_intervals(self.layer, step_tensors(self.batch, self.device), self.total_k)

        return self.cached("columns", build)

    def seq_slice(self, i: int) -> slice:
        """Rows of sequence ``i`` in the packed query tensors."""
        start = sum(s.q_len for s in self.batch.seqs[:i])
        return slice(start, start + self.batch.seqs[i].q_len)

    def to_dense(self, i: int) -> torch.Tensor:
        """Boolean ``[q_len, kv_len]`` mask of sequence ``i`` (True = attend)."""
        rows = self.seq_slice(i)
        return self.dense_rows(rows, int(self.cu_seqlens_k[i]), self.batch.seqs[i].kv_len)

    def dense_rows(self, rows: slice, k0: int, kv_len: int) -> torch.Tensor:
        """Boolean ``[rows, kv_len]`` mask of packed query ``rows`` of one sequence, whose keys
        are packed rows ``k0..k0 + kv_len - 1``: the intervals, and the span groups' part."""
        mask = dense_from_intervals(self.lo[rows], self.hi[rows], kv_len)
        if self.groups is not None:
            mask |= self.groups.dense(rows, slice(k0, k0 + kv_len), self.lo[rows])
        return mask

    def allowed_pairs(self) -> int:
        """Allowed (query, key) pairs of the step; FLOPs are ``4 * D * Hq`` times this."""
        pairs = int((self.hi.long() - self.lo.long() + 1).sum())
        if self.groups is not None:
            pairs += self.groups.extra_pairs(*self.packed_intervals())
        return pairs

    def density(self) -> float:
        """Allowed pairs over all ``q_len * kv_len`` pairs."""
        return self.allowed_pairs() / sum(s.q_len * s.kv_len for s in self.batch.seqs)

    def describe(self) -> str:
        """A few lines per sequence: lengths, flags, spans and how much of the mask is allowed."""
        lo, hi = self.lo.cpu(), self.hi.cpu()
        w = self.layer.window
        lines = [
            f"Plan: {self.num_seqs} seqs, {self.total_q} queries, {self.total_k} keys, "
            f"window={w}, spans={self.layer.spans!r}, device={self.device}"
            + (f", {self.groups.num_groups} span groups" if self.groups is not None else ""),
            f"  allowed pairs {self.allowed_pairs():,} (density {self.density():.3f})",
        ]
        for i, s in enumerate(self.batch.seqs):
            r = self.seq_slice(i)
            spans = ", ".join(f"[{a},{b}]" + ("" if g is None else f"g{g}") for a, b, g in s.grouped_spans())
            spans = spans or "-"
            lines.append(
                f"  seq {i}: q {s.q_len} of kv {s.kv_len} (ctx {s.ctx}), "
                f"{'causal' if s.causal else 'non-causal'}, spans {spans}, "
                f"first row [{int(lo[r.start])},{int(hi[r.start])}], "
                f"last row [{int(lo[r.stop - 1])},{int(hi[r.stop - 1])}]"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Plan(num_seqs={self.num_seqs}, total_q={self.total_q}, total_k={self.total_k}, "
            f"layer={self.layer!r}, device={str(self.device)!r})"
        )


def plan(batch: Batch, layer: LayerMask, device: str | torch.device = "cpu") -> Plan:
    """Compute the intervals and packing of one step for one kind of layer.

    >>> import spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=4, spans=[(1, 2)])]), sa.LayerMask(window=2))
    >>> p.lo.tolist(), p.hi.tolist()
    ([0, 0, 1, 2], [0, 2, 2, 3])
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"plan(batch=...) must be a spanattn.Batch, got {type(batch).__name__}")
    if not isinstance(layer, LayerMask):
        raise TypeError(f"plan(layer=...) must be a spanattn.LayerMask, got {type(layer).__name__}")
    step = step_tensors(batch, check_device("plan(device=...)", device))
    lo, hi = compute_intervals(layer, step, batch.total_q)
    return Plan(
        batch=batch,
        layer=layer,
        lo=lo,
        hi=hi,
        cu_seqlens_q=step["cu_seqlens_q"],
        cu_seqlens_k=step["cu_seqlens_k"],
        seq_lens=step["kv_len"],
        groups=span_groups(layer, step, batch.total_q, batch.total_k),
    )
