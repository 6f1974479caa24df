"""Plans built on the device: an engine that keeps its step metadata on the GPU plans attention
without a host sync, into buffers of a fixed capacity, so that planning and attention of a whole
step (every layer kind) fit in ONE CUDA graph that replays on new metadata of the same capacity.

>>> import torch, spanattn as sa
>>> planner = sa.DevicePlanner({"sliding": sa.LayerMask(window=4, spans="clamp")},
...                            max_seqs=2, max_tokens=8, max_kv_len=16, max_spans=2)
>>> plans = planner.update(torch.tensor([5, 1]), torch.tensor([5, 9]),
...                        spans=torch.tensor([[0, 1, 3]]))
>>> plans["sliding"].lo.tolist()[:6], plans["sliding"].hi.tolist()[:6]
([0, 0, 0, 0, 1, 5], [0, 3, 3, 3, 4, 8])

Against a host plan (:func:`spanattn.plan`), lengths are capacities: ``q`` has ``max_tokens``
rows, the step's queries first (rows after them are padding: their outputs are undefined);
``num_seqs`` is ``max_seqs`` (a sequence with ``q_len`` 0 is padding); span rows with a
negative sequence are padding. The rules spec.py checks on the host are checked here on the
device, per sequence (``RULES``): a sequence that breaks one gets the empty interval on all its
rows, so its output rows are NaN and no other sequence's change; ``errors`` records the rule
and :meth:`DevicePlanner.check` (a host sync, when the engine chooses) raises on it. Left to
the engine: spans past the prompt (a span starting at or past ``kv_len`` is taken as a later
chunk's) and the block table's and slot mapping's entries (each sequence's own pages). Span
groups are planned on the host only: a spans tensor with a group column is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import backends
from .arguments import device as check_device
from .arguments import fit_int32
from .device_plan import Capacity, DevicePlan
from .device_rules import RULES, device_step
from .intervals import compute_intervals
from .spec import LayerMask

INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
# Backends that cannot run a device plan, and why (the others declare DEVICE_PLANS = True).
REFUSED = {
    "fa4": "FA4's varlen call takes the step's exact max_seqlen_q/k and its sparse path host-built "
    "tables; plan on the host (spanattn.plan) for fa4",
    "flex": "flex's BlockMask tables are sized by the step's exact token counts; plan on the host "
    "(spanattn.plan) for flex",
}


def refusal(name: str) -> str | None:
    """Why backend ``name`` cannot run a device plan, or None if it can."""
    if getattr(backends.load(name), "DEVICE_PLANS", False):
        return None
    return REFUSED.get(name, f"the {name} backend does not read device plans")


class DevicePlanner:
    """Fixed-capacity buffers and the plans of every layer kind of a step, refreshed in place.

    layers: name -> LayerMask, one plan per layer kind (``plans[name]``), all sharing the step's
        lengths. max_seqs, max_tokens: sequences and packed queries a step may hold. max_kv_len:
        keys one sequence may have (a paged block table needs ``max_kv_len`` keys per row).
        max_spans: span rows per step. max_q_len: queries one sequence may have (default
        ``max_tokens``); at most 16 sends every step to triton's split-KV decode kernel.
        max_kv_tokens: packed K/V rows, for plans that read packed K/V (paged caches need none).
        allow_split_spans: as in spanattn.Batch.
    """

    def __init__(
        self,
        layers: Mapping[str, LayerMask],
        *,
        max_seqs: int,
        max_tokens: int,
        max_kv_len: int,
        max_spans: int = 0,
        max_q_len: int | None = None,
        max_kv_tokens: int | None = None,
        allow_split_spans: bool = False,
        device="cpu",
    ):
        if not isinstance(layers, Mapping) or not layers:
            raise TypeError("DevicePlanner(layers=...) must be a non-empty {name: LayerMask} mapping")
        for name, layer in layers.items():
            if not isinstance(layer, LayerMask):
                raise TypeError(f"layers[{name!r}] must be a spanattn.LayerMask, got {type(layer).__name__}")
        self.capacity = Capacity(
            max_seqs, max_tokens, max_kv_len, max_spans,
            max_tokens if max_q_len is None else max_q_len, max_kv_tokens, allow_split_spans,
        )  # fmt: skip
        self.device = check_device("DevicePlanner(device=...)", device)
        cap, dev = self.capacity, self.device
        i32 = dict(dtype=torch.int32, device=dev)
        self._q_len = torch.zeros(cap.max_seqs, **i32)
        self._kv_len = torch.zeros(cap.max_seqs, **i32)
        self._causal = torch.ones(cap.max_seqs, **i32)
        self._spans = torch.full((cap.max_spans, 3), -1, **i32)
        self.errors = torch.zeros(cap.max_seqs + 1, len(RULES), **i32)
        cu_q, cu_k = torch.zeros(cap.max_seqs + 1, **i32), torch.zeros(cap.max_seqs + 1, **i32)
        seq_lens, spans = torch.zeros(cap.max_seqs, **i32), torch.zeros(cap.max_spans, 3, **i32)
        # the step as intervals.py reads it: lengths after the rules (kv_len 0: no keys)
        self._step = dict(
            q_len=torch.zeros(cap.max_seqs, **i32), kv_len=seq_lens, causal=self._causal,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, spans=spans, padded=True,
        )  # fmt: skip
        self.plans = {
            name: DevicePlan(
                layer,
                cap,
                torch.zeros(cap.max_tokens, **i32),
                torch.full((cap.max_tokens,), -1, **i32),
                cu_q,
                cu_k,
                seq_lens,
                self.errors,
            )  # fmt: skip
            for name, layer in layers.items()
        }

    def prepare(
        self, backend: str = "triton", *, head_dim: int, dtype=torch.bfloat16, group: int = 1, backward=False
    ):
        """Allocate the tables ``backend`` reads for these head sizes (``group``: query heads per
        KV head; ``backward``: its backward's tables too, for training steps) and rebuild them on
        every :meth:`update`, so attention finds them ready (and a captured graph holds their
        build). Optional: an unprepared table is built per call."""
        why = refusal(backend)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run a device plan: {why}")
        mod = backends.load(backend)
        if backward and not getattr(mod, "backward", None):
            raise ValueError(f"backend={backend!r} has no backward of its own to prepare tables for")
        if hasattr(mod, "prepare"):
            extra = {"backward": True} if backward else {}
            for plan in self.plans.values():
                mod.prepare(plan, head_dim, dtype, group=group, **extra)

    def update(
        self,
        q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
        causal: torch.Tensor | None = None,
        spans: torch.Tensor | None = None,
    ) -> dict[str, DevicePlan]:
        """Plan a step from per-sequence tensors (int32 or int64, on any device; on the planner's
        device nothing synchronizes): ``q_lens, kv_lens [n]`` and ``causal [n]`` (bool or 0/1,
        default all causal) with ``n <= max_seqs`` (missing sequences are padding), ``spans
        [m, 3]`` rows of (sequence, start, end), inclusive absolute positions, ``m <= max_spans``.
        A length or span bound outside int32 rejects its sequence (device_rules.py), never wraps.
        Returns ``plans`` (the same objects every step), their tensors rewritten in place."""
        cap = self.capacity
        unfit_q = self._load(self._q_len, q_lens, "q_lens", 0)
        unfit_kv = self._load(self._kv_len, kv_lens, "kv_lens", 0)
        self._load(self._causal, causal, "causal", 1)
        if torch.is_tensor(spans) and spans.dim() == 2 and spans.shape[1] == 4:
            raise ValueError(
                "spans with a group column: span groups are planned on the host only "
                "(spanattn.plan with Seq spans (start, end, group)); device plans take (sequence, start, end)"
            )
        if spans is not None and (not torch.is_tensor(spans) or spans.dim() != 2 or spans.shape[1] != 3):
            raise ValueError(f"spans must be a [m, 3] tensor of (sequence, start, end) rows, got {spans!r}")
        unfit_spans = self._load(self._spans, spans, "spans", -1)
        unfit = [u for u in (unfit_q, unfit_kv) if u is not None]
        unfit_seqs = torch.stack(unfit).any(0) if unfit else None
        step, errors = device_step(
            self._q_len, self._kv_len, self._causal, self._spans, cap, unfit_seqs, unfit_spans
        )
        self.errors.copy_(errors)
        for key in ("q_len", "kv_len", "cu_seqlens_q", "cu_seqlens_k", "spans"):
            self._step[key].copy_(step[key])
        for plan in self.plans.values():
            lo, hi = compute_intervals(plan.layer, self._step, cap.max_tokens)
            plan.lo.copy_(lo)
            plan.hi.copy_(hi)
            plan._refresh()
        return self.plans

    def _load(self, buf: torch.Tensor, value, name: str, pad: int) -> torch.Tensor | None:
        """Copy ``value`` into the head of ``buf``; the rest is padding. Returns which rows of
        ``buf`` got a length or span bound outside int32 (None: ``value``'s dtype holds none),
        copied clamped rather than wrapped (a wrapped ``2**32 + 3`` would read as 3); device_rules.py
        rejects their sequences. A causal flag clamped keeps its truth: nothing to report."""
        if value is None:
            buf.fill_(pad)
            return None
        if not torch.is_tensor(value) or value.dim() != buf.dim():
            raise ValueError(f"{name} must be a {buf.dim()}-d tensor, got {value!r}")
        flags = name == "causal"
        if value.dtype not in INTEGER_DTYPES or (value.dtype == torch.bool and not flags):
            held = "integers or bools" if flags else "integers (int32 or int64; no bools)"
            raise TypeError(f"{name} must hold {held}, got {value.dtype}")
        n = value.shape[0]
        if n > buf.shape[0]:
            limit = "max_spans" if name == "spans" else "max_seqs"
            raise ValueError(f"{name} has {n} rows, more than {limit}={buf.shape[0]}")
        value, unfit = fit_int32(value)
        buf[:n].copy_(value)
        if n < buf.shape[0]:
            buf[n:].fill_(pad)
        if unfit is None or flags:
            return None
        rows = torch.zeros(buf.shape[0], dtype=torch.bool, device=buf.device)
        rows[:n] = unfit if unfit.dim() == 1 else unfit.any(1)
        return rows

    def check(self) -> None:
        """Raise ValueError naming every sequence whose metadata broke a rule at the last
        :meth:`update` (reads the errors to the host: a sync)."""
        problems = errors_text(self.errors, self._q_len, self._kv_len, self.capacity)
        if problems:
            raise ValueError("device plan: " + "; ".join(problems))


def errors_text(errors, q_len, kv_len, cap: Capacity) -> list[str]:
    """One line per broken rule and sequence (or the step itself)."""
    bad = errors.cpu().tolist()
    q, kv = q_len.cpu().tolist(), kv_len.cpu().tolist()
    lines = []
    for r, row in enumerate(bad):
        who = "the step" if r == cap.max_seqs else f"sequence {r} (q_len {q[r]}, kv_len {kv[r]})"
        lines += [f"{who}: {RULES[j][1].format(cap=cap)}" for j, hit in enumerate(row) if hit]
    return lines
