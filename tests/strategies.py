"""Hypothesis strategies for random steps, shared by every test that checks a layout."""

from __future__ import annotations

from hypothesis import strategies as st

import spanattn as sa

TILE_EDGES = (16, 32, 64, 128)


@st.composite
def spans_in(draw, length: int, max_spans: int = 4):
    """Disjoint spans inside ``[0, length)``, some starting or ending on tile edges."""
    spans, pos = [], 0
    for _ in range(draw(st.integers(0, max_spans))):
        if pos >= length:
            break
        edge = draw(st.sampled_from(TILE_EDGES))
        start = draw(
            st.one_of(st.integers(pos, length - 1), st.just(min(length - 1, -(-pos // edge) * edge)))
        )
        end = draw(
            st.one_of(
                st.integers(start, min(length - 1, start + 300)), st.just(min(length - 1, start + edge - 1))
            )
        )
        spans.append((start, end))
        pos = end + 1 + draw(st.integers(0, 40))
    return spans


@st.composite
def seqs(draw, max_len: int = 600):
    """One sequence: a chunk of ``q_len`` queries at the end of ``kv_len`` keys, whose end cuts
    no span (a span the chunk end would cut ends at the chunk end instead; spans wholly past it
    belong to later chunks of a longer prompt)."""
    kv_len = draw(st.integers(1, max_len))
    q_len = draw(st.one_of(st.integers(1, kv_len), st.just(1), st.just(kv_len)))
    spans = draw(spans_in(kv_len + draw(st.integers(0, 50))))
    spans = [(s, min(e, kv_len - 1)) if s < kv_len else (s, e) for s, e in spans]
    prompt_len = max([kv_len] + [e + 1 for _, e in spans])
    return sa.Seq(q_len=q_len, kv_len=kv_len, spans=spans, causal=draw(st.booleans()), prompt_len=prompt_len)


@st.composite
def layers(draw, max_window: int = 600):
    # small windows often: a span wider than the window is where the modes differ
    window = draw(st.one_of(st.none(), st.sampled_from([1, 2, 3, 7, 16, 64]), st.integers(1, max_window)))
    return sa.LayerMask(
        window=window,
        spans=draw(st.sampled_from(["clamp", "on", "off"])),
        noncausal_window=draw(st.sampled_from(["exclusive", "inclusive"])),
    )


@st.composite
def batches(draw, max_seqs: int = 4, max_len: int = 600):
    return sa.Batch(draw(st.lists(seqs(max_len), min_size=1, max_size=max_seqs)))


@st.composite
def grouped_seqs(draw, max_len: int = 300):
    """A sequence with images or frames in span groups (a few ids, so groups have several spans;
    spans near tile edges), some spans past the chunk end in the same groups."""
    kv_len = draw(st.integers(1, max_len))
    q_len = draw(st.one_of(st.integers(1, kv_len), st.just(kv_len)))
    prompt = kv_len + draw(st.integers(0, 60))
    spans, pos = [], draw(st.integers(0, 20))
    item = st.tuples(st.integers(0, 24), st.sampled_from([1, 15, 16, 17, 33]) | st.integers(1, 60))
    for gap, length in draw(st.lists(item, max_size=8)):
        start = pos + gap
        if start + length > prompt:
            break
        spans.append((start, start + length - 1))
        pos = start + length
    groups = draw(st.lists(st.sampled_from([None, 0, 0, 0, 1]), min_size=len(spans), max_size=len(spans)))
    return sa.Seq(q_len, kv_len, spans, draw(st.booleans()), prompt, groups=groups)


@st.composite
def grouped_batches(draw, max_seqs: int = 3, max_len: int = 300):
    """Batches with span groups; a chunk end that cuts a group is allowed (``allow_split_spans``:
    the group capped at the chunk end), which the per-pair predicate describes as well."""
    seqs_ = draw(st.lists(grouped_seqs(max_len), min_size=1, max_size=max_seqs))
    return sa.Batch(seqs_, allow_split_spans=any(s.cut_span() for s in seqs_))
