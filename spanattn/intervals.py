"""The semantics, written once: a step's mask as one interval ``[lo, hi]`` of keys per query.

For query ``q`` (absolute position ``ctx + i``) of a sequence with ``kv_len`` keys:

    base  causal:      [q - W + 1, q]                     (W None: [0, q])
          non-causal:  [q - W + 1, q + W - 1]  exclusive  (|q - k| <  W)
                       [q - W,     q + W]      inclusive  (|q - k| <= W)
    span  on:          [s, e]                  for the span [s, e] holding q
          clamp:       [max(s, q - W + 1), e]
    allowed = base U span, clipped to [0, kv_len - 1]

Both parts contain ``k = q`` so their union is one interval and no row is empty.

Read by columns (what a backward pass walks for each key tile), the same predicate gives for
key ``k`` the queries that see it as one interval too:

    base  causal:      [k, k + W - 1]                     (W None: [k, inf))
          non-causal:  [k - W + 1, k + W - 1]  exclusive  (W None: every query)
                       [k - W,     k + W]      inclusive
    span  on:          [s, e]                  for the span [s, e] holding k
          clamp:       [s, min(e, k + W - 1)]
    seen by = base U span, clipped to the chunk's queries [ctx, kv_len - 1]

Both parts contain ``q = k`` (the span part since ``s <= k <= e``; its clamp cut keeps ``k``
as ``W >= 1``), so their union is one interval; it may be empty after clipping (a cached key
behind every query's window). The same follows from the rows: ``lo`` and ``hi`` never decrease
along a sequence's queries (each piece above is monotone in ``q``; a span only widens the rows
inside it to its own ends), so the rows with ``lo <= k`` are a prefix and those with
``hi >= k`` a suffix of the chunk, and their intersection is an interval.
"""

from __future__ import annotations

import importlib.util

import torch

from .group_tables import group_tables
from .spec import Batch, LayerMask


def step_tensors(batch: Batch, device) -> dict[str, torch.Tensor]:
    """Per-sequence int32 tensors of a step on ``device``, from ONE host-to-device copy (each
    copy from pageable memory is a synchronous transfer, so planning makes exactly one).

    Keys: q_len, kv_len, causal, cu_seqlens_q, cu_seqlens_k ([n + 1]), spans ([m, 3]: seq, s, e;
    only spans that start inside the chunk: later ones hold no query of this step). A step with
    span groups (``Batch.has_span_groups``) also has span_group ([m]: the group's id in the
    step or -1, ``Batch.span_rows``), num_groups (an int), and ``group_tables``' group_spans
    ([m', 3]: group, first and last key row) and group_extents ([num_groups, 2]).
    """
    seqs = batch.seqs
    cu_q, cu_k = [0], [0]
    for s in seqs:
        cu_q.append(cu_q[-1] + s.q_len)
        cu_k.append(cu_k[-1] + s.kv_len)
    rows = batch.span_rows
    spans = [x for i, a, b, _ in rows for x in (i, a, b)]
    per_seq = ([s.q_len for s in seqs], [s.kv_len for s in seqs], [int(s.causal) for s in seqs])
    parts = (*per_seq, cu_q, cu_k, spans)
    groups = [g for *_, g in rows] if batch.has_span_groups else []
    if groups:
        tables = group_tables(rows, cu_k, per_seq[1])
        parts += (groups, *([x for row in t for x in row] for t in tables))
    # Every part starts on 16 bytes: kernels specialize on pointer alignment, so offsets that
    # moved with the number of sequences would compile a kernel twice.
    padded = [x + [0] * (-len(x) % 4) for x in parts]
    buf = torch.tensor([v for x in padded for v in x], dtype=torch.int32).to(device, non_blocking=True)
    views = [t[: len(x)] for t, x in zip(buf.split([len(x) for x in padded]), parts)]
    keys = ("q_len", "kv_len", "causal", "cu_seqlens_q", "cu_seqlens_k")
    step = dict(zip(keys, views[:5]), spans=views[5].view(-1, 3))
    if groups:
        table, extents = views[7].view(-1, 3), views[8].view(-1, 2)
        step.update(span_group=views[6], group_spans=table, group_extents=extents, num_groups=len(extents))
    return step


def seq_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: the sequence of each packed row, from ``cu_seqlens [n + 1]``.

    searchsorted, not repeat_interleave: the latter costs ~20 ms on CPU whatever the size."""
    rows = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)


def fuses(step: dict) -> bool:
    """Do planning's Triton launches replace their torch definitions by default? On CUDA with
    triton installed: there the torch versions are launch-bound."""
    return step["kv_len"].device.type == "cuda" and importlib.util.find_spec("triton") is not None


def compute_intervals(
    layer: LayerMask, step: dict, total_q: int, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo, hi`` (int32 ``[total_q]``, inclusive key positions local to each sequence).

    ``step`` comes from :func:`step_tensors` (or a device plan's buffers, with ``padded``).
    fused: one Triton launch (intervals_triton.py, the same formulas lowered once more); default
    on CUDA when triton is installed, since this torch version is ~20 launches there. Otherwise
    :func:`intervals_torch`, the definition.
    """
    if fused is None:
        fused = fuses(step)
    if fused:
        from .intervals_triton import intervals_triton

        return intervals_triton(layer, step, total_q)
    return intervals_torch(layer, step, total_q)


def intervals_torch(layer: LayerMask, step: dict, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of ``lo, hi``, vectorized over tokens (no Python loop), on any device.

    With ``step["padded"]`` (device plans: fixed capacity, lengths known only on the device) rows
    past the step's last query and rows of sequences whose ``kv_len`` is 0 (empty or rejected
    sequences) get the empty interval ``(0, -1)``: kernels walk no key for them."""
    q_len, kv_len, causal = step["q_len"].long(), step["kv_len"].long(), step["causal"].bool()
    ends = step["cu_seqlens_q"][1:].long()
    token = torch.arange(total_q, device=q_len.device)
    seq_id = seq_ids(step["cu_seqlens_q"], total_q)
    if step.get("padded"):  # rows past the last sequence: any in-range id, overwritten below
        seq_id = seq_id.clamp_max(q_len.shape[0] - 1)
    per_row = lambda t: t.index_select(0, seq_id)  # index_select: advanced indexing is slower
    q = token + per_row(kv_len - ends)
    last = per_row(kv_len) - 1
    row_causal = per_row(causal)

    w = layer.window
    if w is None:
        lo = torch.zeros_like(q)
        hi = torch.where(row_causal, q, last)
    else:
        wide = layer.noncausal_window == "inclusive"
        past = torch.where(row_causal | (not wide), q - w + 1, q - w)
        lo = past.clamp_min(0)
        hi = torch.where(row_causal, q, torch.minimum(q + w - (0 if wide else 1), last))

    if layer.spans != "off" and step["spans"].numel():
        _, inside, s, e = span_holding(step["spans"], seq_id, q)
        span_hi = torch.minimum(e, last)
        if layer.spans == "on" or w is None:
            span_lo = s
        else:
            span_lo = torch.maximum(s, q - w + 1)
        lo = torch.where(inside, torch.minimum(lo, span_lo), lo)
        hi = torch.where(inside, torch.maximum(hi, span_hi), hi)
    if step.get("padded"):
        dead = (token >= ends[-1]) | (last < 0)
        lo, hi = lo.masked_fill(dead, 0), hi.masked_fill(dead, -1)
    return lo.to(torch.int32), hi.to(torch.int32)


def column_intervals(layer: LayerMask, step: dict, total_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``qlo, qhi`` (int32 ``[total_k]``): for each packed key, the queries that see it through
    its interval (module docstring), inclusive query indices of its sequence's chunk
    (``0..q_len - 1``); ``qlo > qhi`` where no query does. Span groups add the queries of the
    key's group (groups.py), which this leaves out as ``lo, hi`` do. Vectorized over tokens
    from :func:`step_tensors`' tensors of a host plan; what backward passes walk, built only
    when one runs."""
    q_len, kv_len, causal = step["q_len"].long(), step["kv_len"].long(), step["causal"].bool()
    starts = step["cu_seqlens_k"][:-1].long()
    seq_id = seq_ids(step["cu_seqlens_k"], total_k)
    per_key = lambda t: t.index_select(0, seq_id)
    k = torch.arange(total_k, device=kv_len.device) - per_key(starts)  # position in the sequence
    ctx, key_causal = per_key(kv_len - q_len), per_key(causal)
    never = torch.full_like(k, 2**40)  # past any query: "no bound" on that side

    w = layer.window
    if w is None:
        first = torch.where(key_causal, k, -never)
        last = never
    else:
        wide = layer.noncausal_window == "inclusive"
        first = torch.where(key_causal, k, k - w + (0 if wide else 1))
        last = torch.where(key_causal | (not wide), k + w - 1, k + w)

    if layer.spans != "off" and step["spans"].numel():
        _, inside, s, e = span_holding(step["spans"], seq_id, k)
        if layer.spans == "clamp" and w is not None:
            e = torch.minimum(e, k + w - 1)
        first = torch.where(inside, torch.minimum(first, s), first)
        last = torch.where(inside, torch.maximum(last, e), last)
    qlo = (first - ctx).clamp_min(0)
    qhi = torch.minimum(last - ctx, per_key(q_len) - 1)
    return qlo.to(torch.int32), qhi.to(torch.int32)


def columns_from_rows(
    lo: torch.Tensor, hi: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`column_intervals`' queries per key (``qlo > qhi`` where none: ``0, -1`` here), read
    from the rows instead of the step's lengths and spans: what a device plan has on the device.
    ``lo, hi`` never decrease along a sequence's rows (module docstring), so the rows with
    ``hi >= k`` are a suffix and those with ``lo <= k`` a prefix of its chunk: two binary
    searches per key over all rows at once, as ``(sequence, bound)`` keys in one sorted order.
    Rows past ``cu_seqlens_q[-1]`` and keys past ``cu_seqlens_k[-1]`` (a device plan's padding)
    see and are seen by nothing; so are a sequence's rows ``(0, -1)`` (a rejected one's).
    Torch ops on the device, no host read: capturable.

    >>> lo, hi = torch.tensor([0, 0, 1, 0]), torch.tensor([0, 1, 2, 0])  # window 2, then a sequence of 1
    >>> columns_from_rows(lo, hi, torch.tensor([0, 3, 4]), torch.tensor([0, 3, 4]), 4)
    (tensor([0, 1, 2, 0], dtype=torch.int32), tensor([1, 2, 2, 0], dtype=torch.int32))
    """
    n = cu_seqlens_q.numel() - 1
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    row_seq = seq_ids(cu_seqlens_q, lo.numel())  # padding rows: n, after every sequence's
    key_seq = seq_ids(cu_seqlens_k, total_k)
    live = key_seq < n
    seq = key_seq.clamp_max(n - 1)
    k = torch.arange(total_k, device=lo.device) - cu_k[seq]
    big = 2**33  # bounds lie in [-1, 2**31): (sequence, bound + 1) as one int64 key
    first = torch.searchsorted(row_seq * big + hi.long() + 1, seq * big + k + 1)  # first row with hi >= k
    last = torch.searchsorted(row_seq * big + lo.long() + 1, seq * big + k + 1, right=True) - 1  # lo <= k
    seen = live & (first <= last)
    qlo = torch.where(seen, first - cu_q[seq], 0)
    qhi = torch.where(seen, last - cu_q[seq], -1)
    return qlo.to(torch.int32), qhi.to(torch.int32)


def span_holding(spans: torch.Tensor, seq_id: torch.Tensor, pos: torch.Tensor):
    """For each ``(seq_id, pos)`` (int64 tensors of one shape): the row of ``spans`` (step_tensors'
    ``[m, 3]`` rows of seq, start, end, m >= 1) that may hold it, whether it does, and that
    span's start and end. Spans are sorted per sequence and disjoint, so the one that may hold
    ``pos`` is the last starting at or before it in the order (sequence, start)."""
    sp = spans.long()
    big = 2**32  # (seq, position) as one int64 key: positions fit int32
    j = torch.searchsorted(sp[:, 0] * big + sp[:, 1], seq_id * big + pos, right=True) - 1
    jc = j.clamp_min(0)
    span_seq, s, e = (sp[:, c].contiguous().index_select(0, jc) for c in range(3))
    return jc, (j >= 0) & (span_seq == seq_id) & (pos <= e), s, e


def dense_from_intervals(lo: torch.Tensor, hi: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean ``[len(lo), kv_len]`` mask with row ``i`` true on ``[lo[i], hi[i]]``."""
    k = torch.arange(kv_len, device=lo.device)
    return (k[None, :] >= lo[:, None]) & (k[None, :] <= hi[:, None])
