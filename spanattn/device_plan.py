"""DevicePlan: a plan whose lengths live only on the device (device_planner.py builds it), read by
the backends through the same attributes as a host plan, with capacities where a host plan has
exact lengths."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .arguments import integer
from .intervals import columns_from_rows, seq_ids
from .spec import LayerMask


@dataclass(frozen=True)
class Capacity:
    """What one step of a device plan may hold (DevicePlanner's arguments of the same names)."""

    max_seqs: int
    max_tokens: int
    max_kv_len: int
    max_spans: int = 0
    max_q_len: int | None = None
    max_kv_tokens: int | None = None
    allow_split_spans: bool = False

    def __post_init__(self):
        if self.max_q_len is None:
            object.__setattr__(self, "max_q_len", self.max_tokens)
        minimum = {"max_seqs": 1, "max_tokens": 1, "max_kv_len": 1, "max_spans": 0, "max_q_len": 1}
        if self.max_kv_tokens is not None:
            minimum["max_kv_tokens"] = 1
        for name, least in minimum.items():
            object.__setattr__(self, name, integer(f"DevicePlanner.{name}", getattr(self, name), least))
        if not isinstance(self.allow_split_spans, bool):
            raise TypeError("DevicePlanner.allow_split_spans must be a bool")


@dataclass(eq=False)
class DevicePlan:
    """One layer kind's plan of a DevicePlanner step; the planner rewrites its tensors in place.

    lo, hi: int32 ``[max_tokens]`` (``(0, -1)``, empty, on padding rows and rejected sequences).
    cu_seqlens_q, cu_seqlens_k: int32 ``[max_seqs + 1]``; seq_lens: int32 ``[max_seqs]`` keys per
    sequence (0 for padding and rejected sequences). errors: the planner's rule table.
    tables: backend tables rebuilt at every update (``_prepare_table``).

    Users read the fields above and pass the plan to :func:`spanattn.attention`; ``slot_mapping``
    gives a step's cache slots. The other methods (``cached``, ``host_layout``,
    ``query_seq_ids``, ``with_keys``) and ``op_meta`` / ``op_tables`` serve the backends and the
    torch ops.
    """

    layer: LayerMask
    capacity: Capacity
    lo: torch.Tensor
    hi: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens: torch.Tensor
    errors: torch.Tensor | None = None
    tables: dict = field(default_factory=dict, repr=False)
    _facts: dict = field(default_factory=dict, repr=False)  # call facts that hold for every step
    _builders: dict = field(default_factory=dict, repr=False)
    batch = None  # no host-side batch: lengths are known on the device only
    groups = None  # span groups are planned on the host only (device_planner.py refuses them)

    def __post_init__(self):
        self._encode()

    @property
    def device(self) -> torch.device:
        return self.lo.device

    # Bounds where a host plan has exact values (backends size launches and buffers by them).
    @property
    def num_seqs(self) -> int:
        return self.capacity.max_seqs

    @property
    def total_q(self) -> int:
        return self.capacity.max_tokens

    @property
    def total_k(self) -> int:
        cap = self.capacity
        return cap.max_kv_tokens or cap.max_seqs * cap.max_kv_len

    @property
    def max_seqlen_q(self) -> int:
        return self.capacity.max_q_len

    @property
    def max_seqlen_k(self) -> int:
        return self.capacity.max_kv_len

    min_seqlen_k = 0  # unknown: a kernel that needs whole key tiles per sequence cannot assume one

    def cached(self, key, build: Callable):
        """A prepared table, else ``build()`` afresh: the plan's contents change every step."""
        table = self.tables.get(key)
        return build() if table is None else table

    def _prepare_table(self, key, build: Callable) -> None:
        """Keep ``build(out)``'s table under ``key``, rebuilt into the same tensors (``out``, the
        table built first with ``out=None``) at every planner update."""
        if key not in self.tables:
            self.tables[key] = build(None)
            self._builders[key] = build
            self._encode()

    def _refresh(self) -> None:
        """Rebuild every prepared table into its tensors (the planner, after an update)."""
        for key, build in self._builders.items():
            build(self.tables[key])

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``qlo, qhi``: int32 ``[total_k]``, the queries that see each key (``Plan.columns``),
        derived from this step's rows on the device (``intervals.columns_from_rows``): no host
        read, built by each backward that asks."""
        return columns_from_rows(self.lo, self.hi, self.cu_seqlens_q, self.cu_seqlens_k, self.total_k)

    def query_seq_ids(self) -> torch.Tensor:
        """int64 ``[max_tokens]``: the sequence of each row (padding rows: the last)."""
        return seq_ids(self.cu_seqlens_q, self.total_q).clamp_max(self.num_seqs - 1)

    def slot_mapping(self, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        """int64 ``[max_tokens]``: the cache slot of each row's key (its sequence's last ``q_len``
        keys are the step's new ones) through ``block_table [max_seqs, >= max_kv_len /
        block_size]``, and ``-1`` (skipped by write_kv_cache) on padding rows and rows of rejected
        sequences. On the device: no sync, capturable. For an engine without its own mapping."""
        need = -(-self.capacity.max_kv_len // integer("block_size", block_size, 1))
        if block_table.dim() != 2 or block_table.shape[0] != self.num_seqs or block_table.shape[1] < need:
            raise ValueError(
                f"block_table must be [max_seqs={self.num_seqs}, >= {need}] for pages of {block_size}, "
                f"got {tuple(block_table.shape)}"
            )
        rows = torch.arange(self.total_q, device=self.device)
        seq = self.query_seq_ids()
        cu_q = self.cu_seqlens_q.long()
        kv = self.seq_lens.long()[seq]
        live = (rows < cu_q[-1]) & (kv > 0)
        pos = torch.where(live, rows - cu_q[seq + 1] + kv, 0)  # new keys end the sequence
        slots = block_table[seq, pos // block_size].long() * block_size + pos % block_size
        return torch.where(live, slots, -1)

    def with_keys(self, cu_seqlens_k: torch.Tensor) -> DevicePlan:
        """The same plan reading its keys at other offsets: capacity, tables and op encoding
        shared, nothing re-encoded. Built while torch.compile traces, attribute by attribute:
        dynamo on torch < 2.13 refuses ``copy.copy``."""
        plan = object.__new__(DevicePlan)  # no __post_init__: its encoding reprs symbolic sizes
        plan.layer, plan.capacity, plan.lo, plan.hi = self.layer, self.capacity, self.lo, self.hi
        plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens = self.cu_seqlens_q, cu_seqlens_k, self.seq_lens
        plan.errors, plan.tables, plan._facts, plan._builders = (
            self.errors,
            self.tables,
            self._facts,
            self._builders,
        )
        plan.op_meta, plan.op_tables = self.op_meta, self.op_tables
        return plan

    def host_layout(self) -> list[tuple[int, int, int, int, int]]:
        """``(i, q_start, q_end, k_start, kv_len)`` of every sequence with queries and keys, read
        to the host: a sync, refused while a CUDA graph is being captured."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a device plan's lengths cannot be read on the host during CUDA graph capture")
        cu_q, cu_k, kv = (t.tolist() for t in (self.cu_seqlens_q, self.cu_seqlens_k, self.seq_lens))
        return [
            (i, cu_q[i], cu_q[i + 1], cu_k[i], kv[i])
            for i in range(self.num_seqs)
            if cu_q[i + 1] > cu_q[i] and kv[i] > 0
        ]

    # The torch ops (ops.py) take a device plan as tensors plus one static string.
    def _encode(self) -> None:
        specs, tensors = [], []
        for key, table in self.tables.items():
            cls = type(table)
            fields = [(f.name, getattr(table, f.name)) for f in dataclasses.fields(table)]
            names = tuple(n for n, val in fields if torch.is_tensor(val))
            static = tuple((n, val) for n, val in fields if not torch.is_tensor(val))
            specs.append((key, cls.__module__, cls.__qualname__, static, names))
            tensors += [getattr(table, n) for n in names]
        layer = (self.layer.window, self.layer.spans, self.layer.noncausal_window)
        self.op_meta = repr((layer, dataclasses.astuple(self.capacity), tuple(specs)))
        self.op_tables = tensors

    @classmethod
    def _from_op(cls, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, tables, meta: str) -> DevicePlan:
        """The plan an op received as ``(tensors, op_meta)``, rebuilt around those tensors."""
        layer, capacity, specs, facts = _decode(meta)
        plan = cls(layer, capacity, lo, hi, cu_seqlens_q, cu_seqlens_k, seq_lens, _facts=facts)
        at = 0
        for key, table_cls, static, names in specs:
            plan.tables[key] = table_cls(**dict(static), **dict(zip(names, tables[at : at + len(names)])))
            at += len(names)
        plan.op_meta, plan.op_tables = meta, list(tables)
        return plan

    def __repr__(self) -> str:
        return f"DevicePlan(layer={self.layer!r}, capacity={self.capacity!r}, device={str(self.device)!r})"


@functools.lru_cache(maxsize=256)
def _decode(meta: str):
    (window, spans, noncausal), capacity, specs = ast.literal_eval(meta)
    out = []
    for key, module, qualname, static, names in specs:
        table_cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        out.append((key, table_cls, static, names))
    # facts: one dict per plan identity, shared by every rebuilt view of it (they hold per step)
    return LayerMask(window, spans, noncausal), Capacity(*capacity), tuple(out), {}
