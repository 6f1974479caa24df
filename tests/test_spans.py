import pytest
import torch

import spanattn as sa


def test_placeholders():
    phs = [
        (5, 4),
        (20, 6, torch.tensor([0, 1, 1, 0, 1, 1]), "image"),
        (40, 8, None, "audio"),
        (60, 3, None, "video"),
    ]
    assert sa.spans_from_placeholders(phs) == [(5, 8), (21, 22), (24, 25), (60, 62)]
    with pytest.raises(ValueError, match="is_embed has 2 entries, length is 3"):
        sa.spans_from_placeholders([(0, 3, [1, 1], "image")])
    with pytest.raises(ValueError, match="offset and length must be >= 0"):
        sa.spans_from_placeholders([(-1, 3)])
    with pytest.raises(
        ValueError, match=r"placeholders overlap: \(offset=20, length=6\) and \(offset=25, length=2\)"
    ):
        sa.spans_from_placeholders([(25, 2), (20, 6, None, "audio")])
    assert sa.spans_from_placeholders([(0, 5), (5, 5)]) == [(0, 4), (5, 9)]  # adjacent is fine


def test_token_types_like_gemma():
    ids = torch.tensor([[0, 1, 1, 0, 2, 1, 0, 1], [1, 1, 1, 0, 0, 0, 0, 0]])
    assert sa.spans_from_token_types(ids) == [[(1, 2), (5, 5), (7, 7)], [(0, 2)]]
    assert sa.spans_from_token_types(ids[0], vision_types=(1, 2)) == [(1, 2), (4, 5), (7, 7)]


def test_drop_wide_spans():
    assert sa.drop_wide_spans([(0, 9), (20, 22)], window=5) == [(20, 22)]
    assert sa.drop_wide_spans([(0, 9)], window=None) == [(0, 9)]


@pytest.mark.parametrize(
    "spans, start, budget, end",
    [
        ([(100, 1219)], 0, 512, 100),  # stop before the image
        ([(100, 1219)], 0, 2000, 2000),  # the image fits
        ([(100, 1219)], 100, 512, 1220),  # the image does not fit the budget: take it whole
        ([(100, 1219)], 500, 100, 1220),  # prefix hit mid-span: finish the span
        ([(10, 19), (20, 29)], 0, 25, 20),  # end between two adjacent spans
        ([(10, 19)], 0, 20, 20),  # end right after a span
    ],
)
def test_max_chunk_end(spans, start, budget, end):
    got = sa.max_chunk_end(spans, start, budget)
    assert got == end
    assert all(not (s < got <= e) for s, e in spans)


def test_max_chunk_end_makes_every_chunk_valid():
    spans = [(3, 40), (41, 41), (60, 200), (250, 260)]
    start, prompt = 0, 300
    while start < prompt:
        end = min(prompt, sa.max_chunk_end(spans, start, 32))
        sa.Batch([sa.Seq(q_len=end - start, kv_len=end, spans=spans, prompt_len=prompt)])
        start = end
