"""The semantics, written once: a step's mask as one interval ``[lo, hi]`` of keys per query.

For query ``q`` (absolute position ``ctx + i``) of a sequence with ``kv_len`` keys:

    base  causal:      [q - W + 1, q]                     (W None: [0, q])
          non-causal:  [q - W + 1, q + W - 1]  exclusive  (|q - k| <  W)
                       [q - W,     q + W]      inclusive  (|q - k| <= W)
    span  on:          [s, e]                  for the span [s, e] holding q
          clamp:       [max(s, q - W + 1), e]
    allowed = base U span, clipped to [0, kv_len - 1]

Both parts contain ``k = q`` so their union is one interval and no row is empty.
"""

from __future__ import annotations

import torch

from .spec import Batch, LayerMask


def seq_metadata(batch: Batch, device) -> dict[str, torch.Tensor]:
    """Per-sequence int64 tensors on ``device`` from one host-to-device copy."""
    rows = [(s.q_len, s.kv_len, int(s.causal)) for s in batch.seqs]
    meta = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    return {"q_len": meta[:, 0], "kv_len": meta[:, 1], "causal": meta[:, 2].bool()}


def compute_intervals(batch: Batch, layer: LayerMask, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``lo, hi`` (int32 ``[total_q]``, inclusive key positions local to each sequence).

    Vectorized over tokens; the only Python loop is over sequences' spans to flatten them.
    """
    total_q = batch.total_q
    meta = seq_metadata(batch, device)
    q_len, kv_len, causal = meta["q_len"], meta["kv_len"], meta["causal"]
    ends = torch.cumsum(q_len, 0)
    token = torch.arange(total_q, device=device)
    # searchsorted instead of repeat_interleave: the latter costs ~20 ms on CPU whatever the size
    seq_id = torch.searchsorted(ends, token, right=True)
    per_row = lambda t: t.index_select(0, seq_id)  # index_select: advanced indexing is slower
    q = token + per_row(kv_len - ends)
    last = per_row(kv_len) - 1
    row_causal = per_row(causal)

    w = layer.window
    big = int(max(s.kv_len for s in batch.seqs)) + 1
    if w is None:
        lo = torch.zeros_like(q)
        hi = torch.where(row_causal, q, last)
    else:
        wide = layer.noncausal_window == "inclusive"
        past = torch.where(row_causal | (not wide), q - w + 1, q - w)
        lo = past.clamp_min(0)
        hi = torch.where(row_causal, q, torch.minimum(q + w - (0 if wide else 1), last))

    # Spans starting past the chunk belong to later chunks: no query of this step is inside them.
    spans = [(i, s, e) for i, seq in enumerate(batch.seqs) for s, e in seq.spans if s < seq.kv_len]
    if layer.spans != "off" and spans:
        sp = torch.tensor(spans, dtype=torch.int64).to(device, non_blocking=True)
        # Spans are sorted per sequence and disjoint, so the span that may hold q is the last one
        # starting at or before q in the order (sequence, start).
        starts = sp[:, 0] * big + sp[:, 1]
        j = torch.searchsorted(starts, seq_id * big + q, right=True) - 1
        jc = j.clamp_min(0)
        span_seq, s, e = (sp[:, c].contiguous().index_select(0, jc) for c in range(3))
        inside = (j >= 0) & (span_seq == seq_id) & (q <= e)
        span_hi = torch.minimum(e, last)
        if layer.spans == "on" or w is None:
            span_lo = s
        else:
            span_lo = torch.maximum(s, q - w + 1)
        lo = torch.where(inside, torch.minimum(lo, span_lo), lo)
        hi = torch.where(inside, torch.maximum(hi, span_hi), hi)
    return lo.to(torch.int32), hi.to(torch.int32)


def dense_from_intervals(lo: torch.Tensor, hi: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean ``[len(lo), kv_len]`` mask with row ``i`` true on ``[lo[i], hi[i]]``."""
    k = torch.arange(kv_len, device=lo.device)
    return (k[None, :] >= lo[:, None]) & (k[None, :] <= hi[:, None])
