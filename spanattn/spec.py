"""What a step looks like: LayerMask, Seq, Batch. The only place input rules are checked."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SPAN_MODES = ("off", "on", "clamp")
NONCAUSAL_WINDOWS = ("exclusive", "inclusive")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class LayerMask:
    """The attention policy of one kind of layer; shared by every layer of that kind.

    window: keys allowed on the past side, the query itself included (``q - k < window``);
        ``None`` means unlimited.
    spans: how multimodal spans act: ``"off"`` ignores them, ``"on"`` is
        ``(causal AND window) OR span`` (Gemma 3 / vLLM), ``"clamp"`` is
        ``(causal OR span) AND past-window`` (Gemma 4 sliding layers).
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
            _check_int("LayerMask.window", self.window, 1)
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
        chunk); unsorted input is sorted, overlaps are an error.
    prompt_len: length of the whole request, when known; spans past ``kv_len`` but inside the
        prompt belong to later chunks and are ignored. Defaults to ``kv_len``.
    causal: ``False`` for bidirectional rows (diffusion canvases, encoders).

    >>> Seq(q_len=2048, kv_len=5000, spans=[(100, 1219)])
    Seq(q_len=2048, kv_len=5000, spans=((100, 1219),), causal=True, prompt_len=5000)
    """

    q_len: int
    kv_len: int | None = None
    spans: Sequence[tuple[int, int]] = ()
    causal: bool = True
    prompt_len: int | None = None

    def __post_init__(self):
        _check_int("Seq.q_len", self.q_len, 1)
        kv_len = self.q_len if self.kv_len is None else _check_int("Seq.kv_len", self.kv_len, 1)
        if kv_len < self.q_len:
            raise ValueError(f"Seq.kv_len ({kv_len}) must be >= Seq.q_len ({self.q_len})")
        prompt_len = kv_len if self.prompt_len is None else self.prompt_len
        _check_int("Seq.prompt_len", prompt_len, kv_len)
        if not isinstance(self.causal, bool):
            raise TypeError(f"Seq.causal must be a bool, got {type(self.causal).__name__}")
        spans = tuple(sorted(_as_span(sp) for sp in self.spans))
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            if s1 <= e0:
                raise ValueError(f"Seq.spans overlap: ({s0}, {e0}) and ({s1}, {e1})")
        if spans and spans[-1][1] >= prompt_len:
            s, e = spans[-1]
            raise ValueError(
                f"Seq.spans: span ({s}, {e}) ends past the prompt (positions 0..{prompt_len - 1}); "
                "pass prompt_len if it belongs to a later chunk"
            )
        object.__setattr__(self, "kv_len", kv_len)
        object.__setattr__(self, "prompt_len", prompt_len)
        object.__setattr__(self, "spans", spans)

    @property
    def ctx(self) -> int:
        """Tokens already in the KV cache before this step's queries."""
        return self.kv_len - self.q_len

    def cut_span(self) -> tuple[int, int] | None:
        """The span this chunk's end cuts (its queries could not see the rest of it), if any."""
        last = self.kv_len - 1
        for s, e in self.spans:
            if s <= last < e:
                return (s, e)
        return None


def _as_span(span) -> tuple[int, int]:
    try:
        s, e = span
    except (TypeError, ValueError):
        raise TypeError(f"Seq.spans: each span must be a (start, end) pair, got {span!r}") from None
    s, e = int(s), int(e)
    if s < 0:
        raise ValueError(f"Seq.spans: span ({s}, {e}) has a negative start")
    if s > e:
        raise ValueError(f"Seq.spans: span ({s}, {e}) has start > end (spans are inclusive)")
    return (s, e)


@dataclass(frozen=True)
class Batch:
    """The sequences of one step, packed in this order.

    A chunk whose end cuts a span is an error (its queries cannot see the rest of their image,
    so the result differs from an unchunked pass); ``allow_split_spans=True`` proceeds with the
    span capped at the chunk end.

    >>> Batch([Seq(4), Seq(q_len=1, kv_len=9)]).total_q
    5
    """

    seqs: tuple[Seq, ...] = field(default=())
    allow_split_spans: bool = False

    def __init__(self, seqs: Iterable[Seq], allow_split_spans: bool = False):
        seqs = tuple(seqs)
        if not seqs:
            raise ValueError("Batch.seqs must hold at least one Seq")
        for i, seq in enumerate(seqs):
            if not isinstance(seq, Seq):
                raise TypeError(f"Batch.seqs[{i}] must be a Seq, got {type(seq).__name__}")
            cut = seq.cut_span()
            if cut is not None and not allow_split_spans:
                raise ValueError(
                    f"Batch.seqs[{i}]: the chunk ends at position {seq.kv_len - 1}, inside span "
                    f"{cut}; its queries could not see the rest of the span. End the chunk at "
                    f"{cut[0]} or {cut[1] + 1} (spanattn.max_chunk_end finds it) or pass "
                    "allow_split_spans=True"
                )
        object.__setattr__(self, "seqs", seqs)
        object.__setattr__(self, "allow_split_spans", allow_split_spans)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_q(self) -> int:
        return sum(s.q_len for s in self.seqs)

    @property
    def total_k(self) -> int:
        return sum(s.kv_len for s in self.seqs)
