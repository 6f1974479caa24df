"""tma_layout.tma_matrix: the 2D matrix TMA reads a [tokens, heads, D] tensor through, for the
layouts callers hand the triton backend (packed varlen, a slice of a fused QKV buffer,
transformers' head-major KV cache). Exact: every element is where the mapping says."""

import pytest
import torch

pytest.importorskip("triton")
from spanattn.backends.triton.tma_layout import tma_matrix, token_major  # noqa: E402

T, H, D = 37, 3, 64


def _agrees(x: torch.Tensor) -> None:
    m = tma_matrix(x)
    assert m is not None
    assert m.matrix.data_ptr() == x.data_ptr() and m.matrix.stride(1) == 1  # no copy
    t, h = torch.meshgrid(torch.arange(x.shape[0]), torch.arange(x.shape[1]), indexing="ij")
    rows = (t + h * m.head_rows)[..., None]
    cols = (h * m.head_cols)[..., None] + torch.arange(x.shape[2])
    assert torch.equal(m.matrix[rows, cols], x)


def test_layouts_callers_hand_in():
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(T, H, D, generator=g)
    _agrees(packed)
    assert tma_matrix(packed)[1:] == (0, D) and token_major(packed)
    fused = torch.randn(T, 3 * H * D, generator=g)[:, H * D : 2 * H * D].view(T, H, D)  # QKV rows
    _agrees(fused)
    assert tma_matrix(fused).matrix.stride(0) == 3 * H * D and token_major(fused)
    cache = torch.randn(1, H, T, D, generator=g)  # transformers: [batch, heads, tokens, D]
    head_major = cache[0].transpose(0, 1)
    _agrees(head_major)
    assert tma_matrix(head_major)[1:] == (T, 0) and not token_major(head_major)
    grown = torch.randn(H, 100, D, generator=g)[:, :T].transpose(0, 1)  # a longer cache's prefix
    _agrees(grown)
    assert tma_matrix(grown)[1:] == (100, 0)
    _agrees(torch.randn(T, 1, D, generator=g))


def test_layouts_tma_cannot_read():
    x = torch.randn(T, 2 * H, D)
    assert tma_matrix(x[:, ::2]) is None  # heads apart
    assert tma_matrix(x[:, :H, : D - 8]) is None  # rows of D - 8 columns inside wider ones
    assert tma_matrix(torch.randn(T * H * D + 1)[1:].view(T, H, D)) is None  # base not 16-byte aligned
    assert tma_matrix(torch.randn(T, H, D, 2)[..., 0]) is None  # column stride 2
    assert tma_matrix(torch.randn(H, D, T).permute(2, 0, 1)) is None  # D-major
    odd = torch.randn(T, H * 3 + 1)[:, : H * 3].view(T, H, 3)
    assert tma_matrix(odd) is None  # rows 40 bytes apart: not 16-byte aligned
