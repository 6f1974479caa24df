"""A step in the layout of the cache's own key buffers, for compiled forwards (torch.compile).

transformers' compiled generation (``generate(..., cache_implementation="static")`` with a
compile config, or a compiled ``model.forward``) builds each step's masks before calling the
compiled forward, and the forward takes them as inputs: SDPA gets a ``[B, 1, q, kv]`` tensor.
:class:`StaticStep` is spanattn's counterpart, built with every :class:`~spanattn.hf.StepMask`:
a device plan (:class:`spanattn.device_plan.DevicePlan`) whose tensors have the same shapes
at every decode step, so the compiled forward neither re-traces nor reads anything back to the
host. It is planned on the device from the step's tensors (the cache's query offset, the 2D
padding mask): a decode step makes no host sync; a prefill reads its image spans once.

Layout (the same for every row, whatever its padding): batch row ``b`` is sequence ``b``; its
keys are the layer's key buffer ``[B, Hkv, L, D]`` row ``b`` from index 0 (absolute position
``kv_offset``) to the step's end: ``kv_end - kv_offset`` keys, the step's ``q`` queries the
last of them. Left padding is cut from the intervals instead of the keys: a row's real queries
see no key before its first real token. Keys are read in place, the buffer viewed as packed
rows with row stride ``D`` and head stride ``L * D``, in which row ``b`` starts at
``b * Hkv * L`` (``cu_seqlens_k``, made per layer from its head count: layer kinds may differ).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

import spanattn as sa
from spanattn.device_plan import Capacity, DevicePlan
from spanattn.intervals import compute_intervals


def needs_spans(layer: sa.LayerMask, q_length: int) -> bool:
    """Whether the spans can change a step's intervals. A single query is the last key, so a
    span reaches no key after it; before it, ``on`` without a window and ``clamp`` never reach
    past the row's own lower bound (intervals.py). Decode steps then read no block ids: no sync."""
    return layer.spans != "off" and (q_length > 1 or (layer.spans == "on" and layer.window is not None))


@dataclass(frozen=True)
class StaticStep:
    """plan: the step's device plan, ``cu_seqlens_k`` for one KV head (see :meth:`plan_for`);
    kv_length: keys each layer of the kind passes (its buffer length ``L``); tails: :meth:`last`
    steps built with it (a plan made while torch.compile traces cannot encode symbolic sizes)."""

    plan: DevicePlan
    kv_length: int
    tails: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, mask, device) -> StaticStep:
        """The static step of a :class:`~spanattn.hf.StepMask`: a few small kernels, and for a
        decode step nothing copied between host and device."""
        batch, _, sq, sk = mask.shape
        if mask.rule.samples is not None:  # one sequence per row here; a packed row holds several
            raise NotImplementedError(
                "spanattn.hf: a packed row (position ids restarting per sample) runs in eager forwards; "
                "under torch.compile spanattn plans one sequence per row"
            )
        device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=device)
        end = mask._kv_end
        if torch.is_tensor(end):  # kv_end - kv_offset keys per row, computed where they live
            kv_len = (end.to(**i32) - mask.kv_offset).reshape(1).repeat(batch)
        else:
            kv_len = torch.full((batch,), end - mask.kv_offset, **i32)
        q_len, causal, cu_q, cu_k, no_spans = _constants(batch, sq, sk, mask.rule.causal, device)
        spans = cls._spans(mask, sq) if needs_spans(mask.rule.layer, sq) else []
        tensors = dict(
            q_len=q_len,
            kv_len=kv_len,
            causal=causal,
            cu_seqlens_q=cu_q,
            spans=torch.tensor(spans, **i32) if spans else no_spans,
        )
        lo, hi = compute_intervals(mask.rule.layer, tensors, batch * sq)
        if mask.padding is not None:  # left padding: no real query sees a key before its row's first
            first = mask.padding.to(**i32).argmax(1)
            start = (first - mask.kv_offset).clamp_min(0).to(torch.int32).repeat_interleave(sq)
            lo = torch.where(start <= hi, torch.maximum(lo, start), lo)
        capacity = Capacity(
            max_seqs=batch, max_tokens=batch * sq, max_kv_len=sk, max_spans=len(spans), max_q_len=sq,
            max_kv_tokens=batch * sk, allow_split_spans=mask.options.allow_split_spans,
        )  # fmt: skip
        step = cls(DevicePlan(mask.rule.layer, capacity, lo, hi, cu_q, cu_k, kv_len), sk)
        if sq > 1:  # generate keeps one position's logits (Gemma 4's KV-shared layers run on it)
            step.tails[1] = step.last(1)
        return step

    @staticmethod
    def _spans(mask, sq: int) -> list[list[int]]:
        """Span rows ``(row, start, end)`` in buffer positions, from the host plan's checked
        batch (one read of the block ids)."""
        batch, rows = mask.sequences(sq)
        if batch is None:
            return []
        if batch.has_span_groups:
            raise NotImplementedError(
                "spanattn.hf: a step with span groups (e.g. Molmo2's images or video frames of one row) "
                "runs in eager forwards and generate() (a compiled decode step holds no group); under "
                "torch.compile spanattn plans on the device, which does not plan span groups"
            )
        return [[r.row, s + r.k0, e + r.k0] for seq, r in zip(batch.seqs, rows) for s, e in seq.spans]

    def last(self, n: int) -> StaticStep:
        """The step of each row's last ``n`` queries (Gemma 4 runs its KV-shared layers on the
        positions it keeps logits for)."""
        if n in self.tails:
            return self.tails[n]
        plan, cap = self.plan, self.plan.capacity
        b, sq = plan.num_seqs, cap.max_q_len
        lo, hi = (t.view(b, sq)[:, sq - n :].flatten().contiguous() for t in (plan.lo, plan.hi))
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=plan.device) * n
        cap = dataclasses.replace(cap, max_tokens=b * n, max_q_len=n)
        plan = dataclasses.replace(plan, lo=lo, hi=hi, cu_seqlens_q=cu_q, capacity=cap)
        return StaticStep(plan, self.kv_length)

    def plan_for(self, kv_heads: int) -> DevicePlan:
        """The plan for a layer whose key buffer has ``kv_heads`` heads (rows at ``b * Hkv * L``)."""
        n = self.plan.num_seqs
        cu_k = torch.arange(n + 1, dtype=torch.int32, device=self.plan.device) * (kv_heads * self.kv_length)
        return self.plan.with_keys(cu_k)


@functools.lru_cache(maxsize=64)
def _constants(batch: int, sq: int, sk: int, causal: bool, device: torch.device):
    """The tensors a step's shape decides (never written): q_len, causal, cu_seqlens_q,
    cu_seqlens_k for one KV head, and an empty span table (a view into a non-empty buffer:
    kernels take its pointer)."""
    i32 = dict(dtype=torch.int32, device=device)
    rows = torch.arange(batch + 1, **i32)
    return (
        torch.full((batch,), sq, **i32),
        torch.full((batch,), int(causal), **i32),
        rows * sq,
        rows * sk,
        torch.full((1, 3), -1, **i32)[:0],
    )


def packed_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` viewed as packed rows ``[(B - 1) * H * L + L, H, D]`` (no copy when ``x``
    is contiguous): row ``b * H * L + t`` of head ``h`` is ``x[b, h, t]``."""
    b, h, n, d = x.shape
    x = x.contiguous()
    return x.as_strided(((b - 1) * h * n + n, h, d), (d, n * d, 1))


def forward(step, query, key, value, scaling, softcap):
    """Attention of ``query [B, Hq, q, D]`` over the key buffers ``[B, Hkv, L, D]`` under
    ``step.static``: what a compiled forward runs. Returns ``(out [B, q, Hq, D], None)``."""
    static: StaticStep | None = step.static
    if static is None:
        if step.static_error is not None:
            raise step.static_error
        raise NotImplementedError(
            "spanattn.hf runs under torch.compile only with masks it built (a StepMask from "
            "transformers' mask functions)"
        )
    b, hq, sq, d = query.shape
    if key.shape[2] != static.kv_length:
        raise RuntimeError(f"keys ({key.shape[2]}) do not match the mask's kv_length ({static.kv_length})")
    if sq != static.plan.capacity.max_q_len:  # queries end at the step's end, as in the host path
        static = static.last(sq)
    q = query.transpose(1, 2).reshape(b * sq, hq, d)
    plan = static.plan_for(key.shape[1])
    o = sa.attention(
        q, packed_rows(key), packed_rows(value), plan, backend=step.options.backend, scale=scaling,
        softcap=softcap,
    )  # fmt: skip
    return o.view(b, sq, hq, o.shape[-1]), None
