"""gluon_deal's host side: how many KV heads a section of the run-time deal holds, and the
counters a launch keeps per stream."""

import pytest
import torch

from spanattn.backends.triton.gluon_deal import Counters, kv_heads_per_section

MB = 1 << 20


@pytest.mark.parametrize(
    ("hkv", "head_bytes", "l2", "expected"),
    [
        (8, 16 * MB, 50 * MB, 2),  # S0 d128 on an H200: 4 heads (64 MB) would not fit
        (8, 32 * MB, 50 * MB, 1),  # S0 d256
        (8, 64 * MB, 50 * MB, 1),  # a head alone larger than L2: still one per section
        (8, 1 * MB, 50 * MB, 8),  # everything fits: the schedule's own order (heads fastest)
        (6, 8 * MB, 50 * MB, 6),
        (6, 10 * MB, 50 * MB, 3),  # a divisor of the KV heads: 5 would fit but does not divide 6
        (1, 100 * MB, 50 * MB, 1),
    ],
)
def test_section_holds_the_most_kv_heads_that_fit(hkv, head_bytes, l2, expected):
    assert kv_heads_per_section(hkv, head_bytes, l2) == expected


def test_counters_start_at_zero_and_are_kept():
    counters = Counters(torch.device("cpu"))
    first = counters()
    assert first.dtype == torch.int32 and first.tolist() == [0, 0]
    assert counters() is first  # one stream: the same pair every launch
    with_flags = Counters(torch.device("cpu"), flags=16)()
    assert with_flags.tolist() == [0] * 18  # the deal's two, then the halved items' warps' flags
