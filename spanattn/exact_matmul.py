"""Matrix products of fp32 values whose bits do not depend on how the BLAS sums: the reference
backend's, so that the oracle returns the same bits for the same inputs call after call.

A CPU BLAS picks its kernel and its split of a sum by thread count and by its operands'
alignment, and a float sum in another order rounds differently: the reference on CPU gave one
fresh process's first call other bits than its second (3.3e-5 apart), and the same values at
another offset other bits. Here every BLAS sum is exact, so its order cannot matter: each
operand is cut into two slices per row of ``a`` (column of ``b``), ``hi`` in units of ``2**(e -
bits)`` and ``lo`` in units of ``2**(e - 2 * bits)``, ``e`` the exponent of the row's largest
entry, with ``bits`` so small that each product's ``K`` terms, integers in a common unit, sum
below ``2**53``: exact in fp64 in any order, with or without FMA. The slice products are added
in one fixed order and rounded to fp32. What the slices leave out, an entry's bits more than
``2 * bits`` below the top bit of its row's largest entry (24 or more for K up to ``2**16``),
is left out the same way on every call. About 3-4x the time of fp32 products on CPU.

>>> import torch
>>> a, b, order = torch.randn(3, 5, 64), torch.randn(3, 64, 7), torch.randperm(64)
>>> torch.equal(exact_matmul(a, b), exact_matmul(a[..., order], b[:, order]))  # another order
True
"""

from __future__ import annotations

import torch


def _slice_into(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor, dim: int, bits: int) -> None:
    """``hi, lo`` (fp64 views of a caller's buffer) with ``x = hi + lo + (less than lo's unit)``:
    ``hi`` a multiple of ``2**(e - bits)`` (at most ``2**bits`` of them), ``e`` the exponent of
    the largest magnitude of ``x``'s slice along ``dim`` (``|x| < 2**e``), ``lo`` a multiple of
    ``2**(e - 2 * bits)``. Rounded by adding and taking back ``1.5 * 2**52`` units: the sum
    keeps whole units only, and both steps are exact."""
    exponent = torch.frexp(x.abs().amax(dim, keepdim=True)).exponent
    shift = torch.ldexp(torch.full_like(exponent, 1.5, dtype=torch.float64), exponent + (52 - bits))
    torch.add(x, shift, out=hi).sub_(shift)
    torch.sub(x, hi, out=lo)  # exact: the bits of x under hi's unit
    shift.mul_(2.0**-bits)
    lo.add_(shift).sub_(shift)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of fp32 operands in one BLAS call whose every sum is exact, then a fixed order.
    Where the output outweighs the operands (attention's scores) the three slice products that
    matter share one sum, ``[a_hi, a_hi, a_lo] @ [b_hi; b_lo; b_hi]``, at narrower slices: the
    output is written once. Otherwise (probabilities times values) ``[a_hi; a_lo] @ [b_hi,
    b_lo]`` gives the four products side by side, each its own sum, added in a fixed order."""
    *batch, m, k = a.shape
    n = b.shape[-1]
    f64 = dict(dtype=torch.float64, device=a.device)
    kappa = max(k - 1, 1).bit_length()  # K terms in a sum: at most 2**kappa
    if m * n > (m + n) * k:  # each sum: K terms up to 2**(3 bits), 2K up to 2**(2 bits)
        bits = (52 - kappa) // 3
        a3, b3 = torch.empty((*batch, m, 3 * k), **f64), torch.empty((*batch, 3 * k, n), **f64)
        _slice_into(a3[..., :k], a3[..., 2 * k :], a, -1, bits)
        _slice_into(b3[..., :k, :], b3[..., k : 2 * k, :], b, -2, bits)
        a3[..., k : 2 * k].copy_(a3[..., :k])
        b3[..., 2 * k :, :].copy_(b3[..., :k, :])
        return (a3 @ b3).float()
    bits = (52 - kappa) // 2  # each sum: K terms up to 2**(2 bits)
    a2, b2 = torch.empty((*batch, 2 * m, k), **f64), torch.empty((*batch, k, 2 * n), **f64)
    _slice_into(a2[..., :m, :], a2[..., m:, :], a, -1, bits)
    _slice_into(b2[..., :n], b2[..., n:], b, -2, bits)
    parts = a2 @ b2  # [a_hi; a_lo] x [b_hi, b_lo]
    hi, lo = parts[..., :m, :], parts[..., m:, :]
    return ((hi[..., :n] + hi[..., n:]) + (lo[..., :n] + lo[..., n:])).float()


class _ExactMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _product(a, b)

    @staticmethod
    @torch.autograd.function.once_differentiable  # its slicing writes into buffers: no graph of its own
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return _product(grad, b.transpose(-1, -2)), _product(a.transpose(-1, -2), grad)


def exact_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of fp32 ``[..., M, K]`` and ``[..., K, N]``, fp32, the same bits whatever the
    BLAS's threads, kernels and operand alignment (the module docstring says how); its gradient
    is the same kind of product."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _ExactMatmul.apply(a, b)
    return _product(a, b)  # autograd.Function's own cost is a third of a small product's
