"""spec.py's rules, checked on the device for a device plan (device_planner.py): no host sync, so
no exception either. A sequence that breaks a rule is recorded in an errors table and given
``kv_len`` 0, which intervals.py turns into the empty interval on its rows: its output is NaN,
and every other sequence keeps its own rows, keys and offsets (packed offsets follow the
lengths as given, so the next sequence's keys stay where the engine put them)."""

from __future__ import annotations

import torch

from .arguments import INT32_MAX

# (name, message) per column of the errors table; row ``max_seqs`` is the step itself.
RULES = (
    ("lengths", "needs kv_len >= q_len >= 0"),
    ("max_q_len", "q_len is over max_q_len={cap.max_q_len}"),
    ("max_kv_len", "kv_len is over max_kv_len={cap.max_kv_len}"),
    ("max_tokens", "its queries run past max_tokens={cap.max_tokens}"),
    ("max_kv_tokens", "its keys run past max_kv_tokens={cap.max_kv_tokens}"),
    ("span", "a span has a negative start or start > end (spans are inclusive)"),
    ("overlap", "two of its spans overlap"),
    ("cut", "the chunk ends inside a span (pass allow_split_spans=True to proceed)"),
    ("span_seq", "a span names a sequence >= max_seqs={cap.max_seqs}"),
    ("int32", f"a length or span bound was outside int32 (shown clamped to {INT32_MAX}; nothing truncated)"),
)
COLUMN = {name: j for j, (name, _) in enumerate(RULES)}
LAST = 2**63 - 1  # sort key of a span row that names no sequence: after every real one


def _cu(lengths: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 offsets ``[n + 1]`` capped at ``limit``, and which sequences end past it."""
    ends = lengths.cumsum(0)
    over = ends > limit if limit is not None else torch.zeros_like(ends, dtype=torch.bool)
    ends = ends.clamp_max(2**31 - 1 if limit is None else limit)
    return torch.cat([ends.new_zeros(1), ends]).to(torch.int32), over


def device_step(
    q_len, kv_len, causal, spans, cap, unfit_seqs=None, unfit_spans=None
) -> tuple[dict, torch.Tensor]:
    """The step intervals.py reads (``padded``) and the errors table ``[max_seqs + 1, len(RULES)]``
    (int32, nonzero = broken), from capacity-sized inputs: ``q_len, kv_len, causal
    [max_seqs]``, ``spans [max_spans, 3]`` (padding rows name a negative sequence).
    unfit_seqs, unfit_spans: bool ``[max_seqs]``, ``[max_spans]`` or None, the sequences and span
    rows whose values were outside int32 (clamped into it by the planner)."""
    n = cap.max_seqs
    q, kv = q_len.long(), kv_len.long()
    err = torch.zeros(n + 1, len(RULES), dtype=torch.int32, device=q.device)
    col = lambda name, flags: err[:n, COLUMN[name]].copy_(flags)
    if unfit_seqs is not None:
        col("int32", unfit_seqs)
    real = q > 0  # q_len 0: a padding sequence, whatever its kv_len says
    col("lengths", (q < 0) | (real & (kv < q)))
    col("max_q_len", q > cap.max_q_len)
    col("max_kv_len", real & (kv > cap.max_kv_len))
    q, kv = q.clamp_min(0), kv.clamp_min(0)
    cu_q, over_q = _cu(q, cap.max_tokens)
    cu_k, over_k = _cu(kv, cap.max_kv_tokens)
    col("max_tokens", real & over_q)
    col("max_kv_tokens", real & over_k)
    sorted_spans = _check_spans(spans, q, kv, cap, err, unfit_spans)
    bad = err[:n].amax(1) > 0
    step = dict(
        q_len=cu_q.diff(), kv_len=torch.where(bad | ~real, 0, kv).to(torch.int32),
        causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, spans=sorted_spans, padded=True,
    )  # fmt: skip
    return step, err


def _check_spans(spans, q, kv, cap, err, unfit=None) -> torch.Tensor:
    """Spans sorted by (sequence, start) as intervals.py searches them, rows that name no
    sequence last (sequence ``max_seqs``); span rules recorded per sequence in ``err``, and an
    ``unfit`` row (a bound outside int32) against its sequence, or the step where it names none."""
    n = cap.max_seqs
    if spans.shape[0] == 0:
        return spans
    seq, s, e = (spans[:, c].long() for c in range(3))
    named = (seq >= 0) & (seq < n)
    err[n, COLUMN["span_seq"]] = (seq >= n).any()
    if unfit is not None:
        err[n, COLUMN["int32"]] = (unfit & ~named).any()
        err[:n, COLUMN["int32"]].index_add_(0, seq.clamp(0, n - 1), (unfit & named).to(torch.int32))
    key = torch.where(named, seq * 2**32 + s.clamp(0, 2**31 - 1), LAST)
    order = torch.argsort(key, stable=True)
    seq, s, e, named = seq[order], s[order], e[order], named[order]
    own = seq.clamp(0, n - 1)
    live = named & (q[own] > 0)  # spans of padding sequences hold no query: ignored
    nxt = torch.arange(1, spans.shape[0] + 1, device=seq.device).clamp_max(spans.shape[0] - 1)
    overlap = live & live[nxt] & (seq[nxt] == seq) & (nxt > torch.arange(len(seq), device=seq.device))
    overlap &= s[nxt] <= e
    last = kv[own] - 1
    cut = live & (s <= last) & (last < e) & (not cap.allow_split_spans)
    for name, flags in (("span", live & ((s < 0) | (s > e))), ("overlap", overlap), ("cut", cut)):
        err[:n, COLUMN[name]].index_add_(0, own, flags.to(torch.int32))
    seq = torch.where(named, seq, n)
    return torch.stack([seq, s, e], 1).to(torch.int32)
