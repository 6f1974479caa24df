"""Where spans come from (an engine's placeholders, transformers' token types) and the
scheduler's side of them (chunk ends that cut no span)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .spec import chunk_extents

NON_SPAN_MODALITIES = ("audio",)


def _runs(flags: Sequence[bool], offset: int = 0) -> list[tuple[int, int]]:
    """Inclusive ``(start, end)`` of every maximal run of True, shifted by ``offset``."""
    runs, start = [], None
    for i, f in enumerate(flags):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((offset + start, offset + i - 1))
            start = None
    if start is not None:
        runs.append((offset + start, offset + len(flags) - 1))
    return runs


def spans_from_placeholders(placeholders: Iterable) -> list[tuple[int, ...]]:
    """Spans from an engine's multimodal placeholders.

    Each placeholder is ``(offset, length)``, ``(offset, length, is_embed, modality)`` or
    ``(offset, length, is_embed, modality, group)`` where ``is_embed`` (bool sequence of
    ``length`` or None) marks the tokens that carry embeddings: each contiguous run of them is
    one span (separator tokens break an item into runs). ``group`` (an int >= 0, or None) puts
    every span of the placeholder in that span group (``(start, end, group)`` spans): a video's
    frames with timestamp text between them, or several items the model lets see each other
    (give them the same group). Audio never forms spans: it is attended causally.

    >>> spans_from_placeholders([(5, 4), (20, 6, [0, 1, 1, 0, 1, 1], "image"), (40, 8, None, "audio")])
    [(5, 8), (21, 22), (24, 25)]
    >>> spans_from_placeholders([(3, 9, [1, 1, 1, 0, 0, 1, 1, 1, 0], "video", 0), (20, 2, None, "image", 0)])
    [(3, 5, 0), (8, 10, 0), (20, 21, 0)]
    """
    spans, extents = [], []
    for ph in placeholders:
        offset, length, is_embed, modality, group = (tuple(ph) + (None, "image", None)[len(ph) - 2 :])[:5]
        if offset < 0 or length < 0:
            raise ValueError(f"placeholder {tuple(ph)!r}: offset and length must be >= 0")
        extents.append((offset, offset + length, ph))
        if modality in NON_SPAN_MODALITIES or length == 0:
            continue
        if is_embed is None:
            runs = [(offset, offset + length - 1)]
        else:
            flags = [bool(f) for f in (is_embed.tolist() if torch.is_tensor(is_embed) else is_embed)]
            if len(flags) != length:
                raise ValueError(
                    f"placeholder at {offset}: is_embed has {len(flags)} entries, length is {length}"
                )
            runs = _runs(flags, offset)
        spans.extend(runs if group is None else [(s, e, group) for s, e in runs])
    extents.sort(key=lambda x: x[:2])
    for (_, end, a), (start, _, b) in zip(extents, extents[1:]):
        if start < end:  # two items cannot share a token: the engine's placeholders are wrong
            raise ValueError(f"placeholders overlap: {_short(a)} and {_short(b)}")
    return sorted(spans)


def _short(ph) -> str:
    offset, length = tuple(ph)[:2]
    return f"(offset={offset}, length={length})"


GROUPINGS = ("per_run", "one_block")


def spans_from_token_types(
    token_type_ids: Sequence | torch.Tensor, vision_types: Sequence[int] = (1,), grouping: str = "per_run"
) -> list:
    """Spans as maximal runs of vision tokens, like transformers' mask grouping.

    ``token_type_ids`` is 1-D (one sequence: a list of spans) or 2-D (a batch: a list of lists).
    Gemma 3 uses ``vision_types=(1,)``; Gemma 4's ``mm_token_type_ids`` uses ``(1, 2)``.
    grouping: ``"per_run"`` makes each run its own bidirectional span (Gemma 3/4);
    ``"one_block"`` puts every run of a sequence in ONE span group, ``(start, end, 0)`` spans
    (Molmo2: all image and video-frame tokens of a row see each other, the text between them
    stays causal).

    >>> spans_from_token_types([0, 1, 1, 0, 2, 1, 0], vision_types=(1, 2))
    [(1, 2), (4, 5)]
    >>> spans_from_token_types([0, 1, 1, 0, 0, 1, 0], grouping="one_block")
    [(1, 2, 0), (5, 5, 0)]
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
    ids = torch.as_tensor(token_type_ids)
    if ids.dim() == 2:
        return [spans_from_token_types(row, vision_types, grouping) for row in ids]
    if ids.dim() != 1:
        raise ValueError(f"token_type_ids must be 1-D or 2-D, got shape {tuple(ids.shape)}")
    is_vision = torch.isin(ids, torch.as_tensor(list(vision_types), dtype=ids.dtype))
    runs = _runs(is_vision.tolist())
    return runs if grouping == "per_run" else [(s, e, 0) for s, e in runs]


def drop_wide_spans(spans: Iterable[tuple[int, ...]], window: int | None) -> list[tuple[int, ...]]:
    """vLLM's former policy, kept for parity: spans longer than the window are dropped, so
    their tokens fall back to plain causal attention (``(start, end, group)`` spans keep their
    group)."""
    if window is None:
        return list(spans)
    return [sp for sp in spans if sp[1] - sp[0] + 1 <= window]


def max_chunk_end(spans: Iterable[tuple[int, ...]], start: int, budget: int) -> int:
    """The largest exclusive chunk end in ``(start, start + budget]`` that cuts no span and no
    span group (spans may be ``(start, end, group)`` triples).

    A chunk ``[start, end)`` cuts span ``[s, e]`` when ``s < end <= e``; it cuts a span group
    when it holds a query of the group and ends before the group's last span does
    (``spanattn.spec.chunk_extents``: the hull of the group's spans from ``start`` on acts as
    one span). If every end in range cuts something (a span or group longer than the budget
    starts at or holds ``start``), the smallest end past it is returned so the scheduler still
    makes progress; it exceeds the budget.

    >>> max_chunk_end([(100, 1219)], start=0, budget=512)
    100
    >>> max_chunk_end([(100, 1219)], start=100, budget=512)
    1220
    >>> max_chunk_end([(10, 265, 0), (282, 537, 0)], start=0, budget=400)
    10
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    extents = [(s, e) for s, e, _ in chunk_extents(spans, start)]
    cuts = lambda end: [e for s, e in extents if s < end <= e]
    # the largest legal end is the budget's end or the start of some extent
    for end in sorted(
        {start + budget} | {s for s, _ in extents if start < s <= start + budget}, reverse=True
    ):
        if not cuts(end):
            return end
    end = start + 1
    while cuts(end):
        end = max(cuts(end)) + 1
    return end
