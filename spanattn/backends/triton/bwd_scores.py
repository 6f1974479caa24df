"""The backward's row statistics and score gradients, written once for the dQ kernel
(kernel_dq.py) and the dK/dV kernel (kernel_dkdv.py).

Scores live in the forward's log2 domain (scales.kernel_scales): with ``lse2 = lse * log2(e)``
a tile's probabilities are ``p = exp2(s * qk_scale - lse2)`` from its raw scores ``s = q . k``,
exactly the forward's ``p`` over its final row sum. The gradient of the scores is ``ds = p *
(dp - delta)`` with ``dp = dO . v`` and ``delta = rowsum(dO * O) - dlse`` (an LSE output's
gradient enters as ``d lse / d s = p``); a softcap's ``c * tanh(raw * scale / c)`` multiplies
it by ``1 - tanh^2``. The kernels multiply by ``scale`` once, at their stores.
"""

import triton
import triton.language as tl

from .scales import LOG2E

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def bwd_preprocess(
    OUT, DO, LSE, DLSE, DELTA, LSE2, total_q, stride_ot, stride_oh, stride_dot, stride_doh, stride_lt,
    stride_lh, stride_dlt, stride_dlh, HQ: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """``delta`` and ``lse2`` (fp32, ``[total_q, HQ]`` contiguous) of ``BLOCK`` rows of one head:
    what every tile of the two gradient kernels reads per row, computed once."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    ok = rows < total_q
    rows = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    cell = ok[:, None] & (offs_d[None, :] < D)
    o = tl.load(OUT + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=cell, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=cell, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + rows * stride_dlt + head * stride_dlh, mask=ok, other=0.0)
    lse = tl.load(LSE + rows * stride_lt + head * stride_lh, mask=ok, other=0.0)
    tl.store(DELTA + rows * HQ + head, delta, mask=ok)
    tl.store(LSE2 + rows * HQ + head, lse * _LOG2E, mask=ok)


@triton.jit
def score_grads(s, dp, lse2, delta, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """``p`` and the gradient of the raw scores (before ``scale``) of one tile, unmasked: the
    caller selects its allowed entries with ``tl.where`` (a masked score may give an inf ``p``
    and a NaN gradient, never selected). ``lse2`` and ``delta`` come broadcast to ``s``'s shape
    (the dK/dV kernel's tiles are transposed)."""
    if SOFTCAP:
        # The forward's tanh (kernel._softmax), 1 - r with r = 2 / (exp(2x) + 1), and its
        # derivative 1 - tanh^2 = r (2 - r) from the same r: no cancellation where tanh
        # saturates (r -> 0 or 2).
        r = 2.0 / (tl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)
        p = tl.exp2((1.0 - r) * softcap_log2 - lse2)
        ds = p * (dp - delta) * (r * (2.0 - r))
    else:
        p = tl.exp2(s * qk_scale - lse2)
        ds = p * (dp - delta)
    return p, ds
