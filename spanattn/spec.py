"""What a step looks like: LayerMask, Seq, Batch. The only place input rules are checked."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .arguments import INT32_MAX, INT32_WHY, integer

SPAN_MODES = ("off", "on", "clamp")
NONCAUSAL_WINDOWS = ("exclusive", "inclusive")
# Windows are added to int32 positions in int64 (intervals.py): any bound that cannot overflow
# there will do, since a window longer than every sequence is no window.
MAX_WINDOW = 2**62
WINDOW_LIMIT = "the window limit (added to positions in int64; a window longer than every sequence is None)"


@dataclass(frozen=True)
class LayerMask:
    """The attention policy of one kind of layer; shared by every layer of that kind.

    window: keys allowed on the past side, the query itself included (``q - k < window``);
        ``None`` means unlimited.
    spans: how multimodal spans act: ``"off"`` ignores them (Gemma 4's global layers), ``"on"``
        is ``(causal AND window) OR span`` (vLLM's Gemma 3 on every layer, transformers' Gemma 3
        on its global layers), ``"clamp"`` is ``(causal OR span) AND past-window`` (Gemma 4's
        sliding layers, and transformers' Gemma 3 sliding layers). Gemma 3 in vLLM and in
        transformers differ only for an image wider than the window (docs/design.md section 2).
    noncausal_window: the window of non-causal rows, ``"exclusive"`` keeps ``|q-k| < window``
        (vLLM, Gemma 3's bidirectional overlay), ``"inclusive"`` keeps ``|q-k| <= window``
        (transformers' ``sliding_window_bidirectional_overlay``).

    >>> LayerMask(window=1024, spans="clamp")
    LayerMask(window=1024, spans='clamp', noncausal_window='exclusive')
    """

    window: int | None = None
    spans: str = "on"
    noncausal_window: str = "exclusive"

    def __post_init__(self):
        if self.window is not None:
            window = integer("LayerMask.window", self.window, 1, MAX_WINDOW, WINDOW_LIMIT)
            object.__setattr__(self, "window", window)
        if self.spans not in SPAN_MODES:
            raise ValueError(f"LayerMask.spans must be one of {SPAN_MODES}, got {self.spans!r}")
        if self.noncausal_window not in NONCAUSAL_WINDOWS:
            raise ValueError(
                f"LayerMask.noncausal_window must be one of {NONCAUSAL_WINDOWS}, "
                f"got {self.noncausal_window!r}"
            )


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: ``q_len`` new queries at the end of ``kv_len`` keys.

    spans: inclusive absolute ``(start, end)`` positions of multimodal items (never rebased per
        chunk); unsorted input is sorted, overlaps are an error. A span given as ``(start, end,
        group)`` belongs to span group ``group`` (an int >= 0, naming a group of this sequence
        only): a query inside any span of a group also sees every key inside the group's other
        spans (several images or video frames that all see each other; docs/design.md section 2).
    prompt_len: length of the whole request, when known; spans past ``kv_len`` but inside the
        prompt belong to later chunks and are ignored, except that a chunk must not end while a
        group it holds queries of has spans left. Defaults to ``kv_len``.
    causal: ``False`` for bidirectional rows (diffusion canvases, encoders).
    groups: the group of each span after sorting (None: no group); ``()`` when no span has one.
        Filled from ``(start, end, group)`` spans, or given with pairs in ``spans``.

    >>> Seq(q_len=2048, kv_len=5000, spans=[(100, 1219)])
    Seq(q_len=2048, kv_len=5000, spans=((100, 1219),), causal=True, prompt_len=5000)
    >>> Seq(q_len=600, spans=[(290, 545, 0), (10, 265, 0)]).groups
    (0, 0)
    """

    q_len: int
    kv_len: int | None = None
    spans: Sequence[tuple[int, ...]] = ()
    causal: bool = True
    prompt_len: int | None = None
    groups: Sequence[int | None] = ()

    def __post_init__(self):
        q_len = integer("Seq.q_len", self.q_len, 1)
        kv_len = q_len if self.kv_len is None else integer("Seq.kv_len", self.kv_len, 1)
        if kv_len < q_len:
            raise ValueError(f"Seq.kv_len ({kv_len}) must be >= Seq.q_len ({q_len})")
        prompt_len = kv_len if self.prompt_len is None else integer("Seq.prompt_len", self.prompt_len, kv_len)
        if not isinstance(self.causal, bool):
            raise TypeError(f"Seq.causal must be a bool, got {type(self.causal).__name__}")
        if not isinstance(self.spans, (tuple, list)) and (
            isinstance(self.spans, (str, bytes)) or not isinstance(self.spans, Iterable)
        ):
            raise TypeError(
                "Seq.spans must be a sequence of (start, end) or (start, end, group) spans, "
                f"got {self.spans!r}"
            )
        spans = sorted(_with_groups(self.spans, self.groups))
        for (s0, e0, _), (s1, e1, _) in zip(spans, spans[1:]):
            if s1 <= e0:
                raise ValueError(f"Seq.spans overlap: ({s0}, {e0}) and ({s1}, {e1})")
        if spans and spans[-1][1] >= prompt_len:
            s, e, _ = spans[-1]
            raise ValueError(
                f"Seq.spans: span ({s}, {e}) ends past the prompt (positions 0..{prompt_len - 1}); "
                "pass prompt_len if it belongs to a later chunk"
            )
        groups = tuple(g for _, _, g in spans)
        object.__setattr__(self, "q_len", q_len)
        object.__setattr__(self, "kv_len", kv_len)
        object.__setattr__(self, "prompt_len", prompt_len)
        object.__setattr__(self, "spans", tuple((s, e) for s, e, _ in spans))
        object.__setattr__(self, "groups", groups if any(g is not None for g in groups) else ())

    def __repr__(self) -> str:
        text = (
            f"Seq(q_len={self.q_len}, kv_len={self.kv_len}, spans={self.spans!r}, "
            f"causal={self.causal}, prompt_len={self.prompt_len}"
        )
        return text + (f", groups={self.groups!r})" if self.groups else ")")

    @property
    def ctx(self) -> int:
        """Tokens already in the KV cache before this step's queries."""
        return self.kv_len - self.q_len

    def grouped_spans(self) -> list[tuple[int, int, int | None]]:
        """``(start, end, group or None)`` of every span, sorted."""
        groups = self.groups or (None,) * len(self.spans)
        return [(s, e, g) for (s, e), g in zip(self.spans, groups)]

    def cut_span(self) -> tuple[int, int, int | None] | None:
        """What this chunk's end cuts, if anything: ``(start, end, group)`` of a span (group
        None) or of a span group's spans from the first query on (``chunk_extents``) that the
        last key lies inside, so that queries of it could not see the rest."""
        last = self.kv_len - 1
        for s, e, g in chunk_extents(self.grouped_spans(), self.ctx):
            if s <= last < e:
                return (s, e, g)
        return None


def chunk_extents(spans, start: int) -> list[tuple[int, int, int | None]]:
    """What a chunk whose queries start at ``start`` must not end inside, sorted: every span
    without a group, and for each span group the hull of its spans that end at or after
    ``start``. A query of a group sees all of the group's spans, so a chunk holding one may end
    only after the group's last span (or before the group's first span at or after ``start``).

    ``spans``: ``(start, end)`` or ``(start, end, group)`` items, group None for none.

    >>> chunk_extents([(10, 19, 0), (30, 39), (50, 59, 0), (70, 79, 1)], start=0)
    [(10, 59, 0), (30, 39, None), (70, 79, 1)]
    >>> chunk_extents([(10, 19, 0), (50, 59, 0)], start=25)
    [(50, 59, 0)]
    """
    out, hulls = [], {}
    for s, e, g in _with_groups(spans, ()):
        if g is None:
            out.append((s, e, None))
        elif e >= start:
            a, b = hulls.get(g, (s, e))
            hulls[g] = (min(a, s), max(b, e))
    return sorted(out + [(a, b, g) for g, (a, b) in hulls.items()], key=lambda x: x[:2])


def _with_groups(spans, groups) -> list[tuple[int, int, int | None]]:
    """``(start, end, group)`` items from pairs or triples and an optional ``groups`` list."""
    items = [_as_span(sp) for sp in spans]
    if groups:
        if any(g is not None for _, _, g in items):
            raise ValueError(
                "Seq: give span groups either as (start, end, group) spans or as groups=, not both"
            )
        if len(groups) != len(items):
            raise ValueError(f"Seq.groups has {len(groups)} entries for {len(items)} spans")
        items = [(s, e, _as_group(g)) for (s, e, _), g in zip(items, groups)]
    return items


def _as_group(g) -> int | None:
    if g is None:
        return None
    try:
        return integer("Seq.spans: a span group", g, 0)
    except (TypeError, ValueError):
        raise ValueError(f"Seq.spans: a span group must be an int >= 0 or None, got {g!r}") from None


def _as_span(span) -> tuple[int, int, int | None]:
    try:
        s, e, *rest = span
    except (TypeError, ValueError):
        rest = [None, None]
    if len(rest) > 1:
        raise TypeError(
            f"Seq.spans: each span must be a (start, end) pair or a (start, end, group) triple, got {span!r}"
        )
    try:
        s, e = integer("start", s), integer("end", e)
    except (TypeError, ValueError) as err:  # the span's name built only for the message
        raise type(err)(f"Seq.spans: span {tuple(span)!r}'s {err}") from None
    if s < 0:
        raise ValueError(f"Seq.spans: span ({s}, {e}) has a negative start")
    if s > e:
        raise ValueError(f"Seq.spans: span ({s}, {e}) has start > end (spans are inclusive)")
    return (s, e, _as_group(rest[0]) if rest else None)


@dataclass(frozen=True)
class Batch:
    """The sequences of one step, packed in this order.

    A chunk whose end cuts a span is an error (its queries cannot see the rest of their image,
    so the result differs from an unchunked pass), and so is one holding queries of a span group
    whose last span ends after the chunk (``Seq.cut_span``); ``allow_split_spans=True`` proceeds
    with the span or group capped at the chunk end.

    >>> Batch([Seq(4), Seq(q_len=1, kv_len=9)]).total_q
    5
    """

    seqs: tuple[Seq, ...] = field(default=())
    allow_split_spans: bool = False

    def __init__(self, seqs: Iterable[Seq], allow_split_spans: bool = False):
        if isinstance(seqs, Seq) or not isinstance(seqs, Iterable):
            hint = ": wrap it, Batch([seq])" if isinstance(seqs, Seq) else ""
            what = type(seqs).__name__
            raise TypeError(f"Batch.seqs must be a list (an iterable) of Seq, got a {what}{hint}")
        if not isinstance(allow_split_spans, bool):
            raise TypeError(f"Batch.allow_split_spans must be a bool, got {allow_split_spans!r}")
        seqs = tuple(seqs)
        if not seqs:
            raise ValueError("Batch.seqs must hold at least one Seq")
        for i, seq in enumerate(seqs):
            if not isinstance(seq, Seq):
                raise TypeError(f"Batch.seqs[{i}] must be a Seq, got {type(seq).__name__}")
            cut = seq.cut_span()
            if cut is not None and not allow_split_spans:
                s, e, g = cut
                what = (
                    f"span {(s, e)}"
                    if g is None
                    else f"span group {g} (its spans from the chunk's first query on: {s}..{e})"
                )
                raise ValueError(
                    f"Batch.seqs[{i}]: the chunk ends at position {seq.kv_len - 1}, inside {what}; "
                    f"its queries could not see the rest of the {'group' if g is not None else 'span'}. "
                    f"End the chunk at {s} or {e + 1} (spanattn.max_chunk_end finds it) or pass "
                    "allow_split_spans=True"
                )
        totals = {"queries": sum([s.q_len for s in seqs]), "keys": sum([s.kv_len for s in seqs])}
        for what, total in totals.items():
            if total > INT32_MAX:
                raise ValueError(
                    f"Batch: its sequences hold {total} {what} in all, over {INT32_MAX}, the int32 limit "
                    f"of packed offsets ({INT32_WHY}); split the step"
                )
        object.__setattr__(self, "seqs", seqs)
        object.__setattr__(self, "allow_split_spans", allow_split_spans)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_q(self) -> int:
        return sum(s.q_len for s in self.seqs)

    @cached_property
    def span_rows(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(seq, start, end, group)`` of every span that starts inside its chunk (later ones hold
        no query or key of this step), in sequence then start order; ``group`` is the group's id
        in the step, numbered in order of first appearance, or -1: a span without a group, or the
        only one of its group in the step (it acts as a plain span)."""
        rows = [
            (i, a, b, g) for i, s in enumerate(self.seqs) for a, b, g in s.grouped_spans() if a < s.kv_len
        ]
        count = Counter((i, g) for i, _, _, g in rows if g is not None)
        ids: dict = {}
        return tuple(
            (i, a, b, ids.setdefault((i, g), len(ids)) if count[i, g] > 1 else -1) for i, a, b, g in rows
        )

    @property
    def has_span_groups(self) -> bool:
        """Does a span group hold two or more spans of this step (then plans carry group ids)?"""
        return any(g >= 0 for *_, g in self.span_rows)

    @property
    def total_k(self) -> int:
        return sum(s.kv_len for s in self.seqs)
