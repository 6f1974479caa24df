"""The wait for a key tile's P @ V placed where the source puts it: after the softmax of the next
tile, which then runs under it (Hopper).

The kernels issue tile t - 1's P @ V with tile t's Q @ K^T, wait for the scores, run tile t's
softmax and then wait for the P @ V. ptxas (12.8 to 13.4, checked on the SASS) moves a wgmma
wait up to the start of the basic block that holds it: behind the partial-tile mask's branch,
that is before the softmax's row maxima, so a consumer's softmax ran with its own P @ V done,
and at d512, where both consumers meet every tile to add their score halves, with the tensor
cores idle. A branch right before the wait ends the block there; ptxas then waits after the
last exponential (all 66 of a d128 tile's, 34 of d256's, 18 of d512's, against 0, 17 and 0),
converting P to bf16 after the wait, and the register count and spills stay as they were.
FlashAttention-4's SM90 kernel (no branch in its loop) gets the same from ptxas without it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

# A branch that ptxas cannot remove (the operand, a tile count, is never 0xffffffff) around an
# instruction never executed; inside one asm statement so that LLVM cannot fold it either.
_BLOCK_END = gl.constexpr(
    "{ .reg .pred p; setp.eq.u32 p, $1, 0xffffffff; @!p bra.uni blockEnd; membar.cta; blockEnd: "
    "mov.u32 $0, $1; }"
)


@gluon.jit
def wait_pv(acc, tile):
    """``acc`` once the P @ V in flight on it is done (every MMA of the warpgroup waited for),
    the basic block ended first (``tile``: any int32 that is never -1)::

        acc = wait_pv(acc, c + t)
    """
    gl.inline_asm_elementwise(_BLOCK_END, "=r,r", [tile], dtype=gl.int32, is_pure=False, pack=1)
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc])
