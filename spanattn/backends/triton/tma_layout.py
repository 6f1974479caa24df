"""How TMA reads a ``[tokens, heads, D]`` tensor: as a 2D matrix whose element (token ``t``,
head ``h``, column ``d``) sits at row ``t + h * head_rows``, column ``h * head_cols + d``.
Packed varlen tensors hold each token's heads side by side (token-major: ``head_rows = 0``,
``head_cols = D``); transformers' KV cache holds each head's tokens one after another (a
``[heads, tokens, D]`` buffer seen through a transpose: ``head_rows`` = the buffer's tokens per
head, ``head_cols = 0``). TMA needs 16-byte aligned bases and row strides."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TmaMatrix(NamedTuple):
    matrix: torch.Tensor  # 2D, unit column stride, the tensor's own storage
    head_rows: int
    head_cols: int


class TmaForm(NamedTuple):
    """The matrix of ``tma_matrix`` as numbers only (deciding costs no tensor view)."""

    rows: int
    cols: int
    row_stride: int
    head_rows: int
    head_cols: int


def tma_form(t: torch.Tensor) -> TmaForm | None:
    """The shape of the matrix TMA reads ``t [tokens, heads, D]`` through, or None."""
    tokens, heads, d = t.shape
    size = t.element_size()
    if t.stride(2) != 1 or t.data_ptr() % 16 or tokens == 0:
        return None
    if t.stride(1) == d or heads == 1:  # token-major, rows possibly padded (a fused QKV buffer)
        if t.stride(0) * size % 16 or t.stride(0) < heads * d:
            return None
        return TmaForm(tokens, heads * d, t.stride(0), 0, d)
    if t.stride(0) == d and t.stride(1) % d == 0 and t.stride(1) >= tokens * d and d * size % 16 == 0:
        head_rows = t.stride(1) // d
        return TmaForm((heads - 1) * head_rows + tokens, d, d, head_rows, 0)
    return None


def tma_matrix(t: torch.Tensor) -> TmaMatrix | None:
    """``t [tokens, heads, D]`` as a matrix TMA can read (see the module doc), or None."""
    f = tma_form(t)
    if f is None:
        return None
    return TmaMatrix(t.as_strided((f.rows, f.cols), (f.row_stride, 1)), f.head_rows, f.head_cols)


def token_major(t: torch.Tensor) -> bool:
    """Can TMA read ``t`` as a ``[tokens, heads * D]`` matrix (what kernel.py's descriptors
    assume)?"""
    f = tma_form(t)
    return f is not None and f.head_rows == 0


def rebased(desc, t: torch.Tensor):
    """Host TMA descriptor ``desc`` (Triton's or Gluon's ``TensorDescriptor``, made and checked
    once per call shape) onto ``t``, a tensor of the same ``tma_form`` as the one it was made
    over: the launch reads only the base's address and dtype, so ``t`` itself stands for its
    matrix. Skips the constructor's checks and the matrix view (~5 us per descriptor per call)."""
    out = object.__new__(type(desc))
    out.__dict__.update(desc.__dict__)
    out.base = t
    return out
