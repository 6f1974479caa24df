"""Skipping the output rescale of the online softmax where no row's maximum moved much (Gluon,
Hopper). Each key tile rescales the fp32 accumulator by ``alpha = 2^(m_old - m_new)``: at
d512, where a consumer's accumulator is 128 registers a thread and a key tile only 32 keys,
those 128 multiplies per tile stand between the previous P @ V and the next Q @ K^T. As
FlashAttention-4 does on Blackwell, the running maximum a row's exponentials are taken against
moves only when a tile's scores pass it by more than ``SKIP_LOG2`` (in log2 units): the
exponentials then stay below ``2^SKIP_LOG2``, which fp32 sums and bf16/fp16 probabilities hold
with the same relative rounding, and ``alpha`` is exactly 1 for the rows that did not move.
A warp whose rows all kept their maximum branches past the multiplies (d512); at d256
(kernel_gluon, 64-key tiles) the consumer warpgroup skips them when none of its 4 warps moved,
a branch of the whole warpgroup decided by one cross-warp reduction a tile, off the softmax's
path (S0 / S2 d256 5.3 / 4.9% less time on the H200; per warp, by the asm branch below, S0
d256 had gained 0.8% and the short walks lost 2-3%).

The decision is per warp (16 rows) and only counts the item's own rows: rows past a sequence's
end hold another sequence's queries, and letting them decide would make one request's values
change when its neighbour's rescales happen, i.e. its rounding (docs/design.md section 3's
isolation). Both consumers of the d512 kernel see the same scores, so they decide alike."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SKIP_LOG2 = gl.constexpr(8.0)

# Any row of the warp: a thread holds two rows of the accumulator layout, the vote covers the
# warp's other threads. ``vote.sync`` needs every lane: the callers run it outside any branch,
# and both asm blocks are marked as having side effects so that no compiler pass moves one into
# a branch or copies the other's labels (the PTX is the same either way on triton 3.6).
_WARP_ANY = gl.constexpr(
    "{ .reg .pred p; .reg .b32 t; or.b32 t, $2, $3; setp.ne.s32 p, t, 0; "
    "vote.sync.any.pred p, p, -1; selp.s32 $0, 1, 0, p; mov.b32 $1, $0; }"
)


def _skip_asm(n: int) -> str:
    """PTX for one thread's ``n`` accumulator values (operands 0..n-1, in place), their rows'
    factors (2n..3n-1) and the warp's decision (3n): the multiplies, or a jump past them."""
    mul = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return f"{{ .reg .pred p; setp.eq.s32 p, ${3 * n}, 0; @p bra.uni SKIP${{:uid}}; {mul} SKIP${{:uid}}: }}"


def _skip_constraints(n: int) -> str:
    """Outputs tied to the accumulator inputs (no copies on the skipping path), then factors and decision."""
    return ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * (2 * n))


# d512's consumers hold 64 rows x 256 columns: 128 fp32 values a thread.
SKIP_ASM = gl.constexpr(_skip_asm(128))
SKIP_CONSTRAINTS = gl.constexpr(_skip_constraints(128))


@gluon.jit
def lazy_max(m_i, m_tile, own):
    """The rows' new reference maxima for a tile whose scaled row maxima are ``m_tile``, and the
    warp's decision (int32, in the rows' layout) whether they moved: all rows of a warp move
    to ``max(m_i, m_tile)`` when one of its ``own`` rows passed its maximum by ``SKIP_LOG2``, else
    none does (a row's first allowed keys always pass ``-inf``)."""
    passed = ((m_tile > m_i + SKIP_LOG2) & own).to(gl.int32)
    moved = gl.inline_asm_elementwise(_WARP_ANY, "=r,=r,r,r", [passed], dtype=gl.int32, is_pure=False, pack=2)
    return gl.where(moved != 0, gl.maximum(m_i, m_tile), m_i), moved


@gluon.jit
def rescale(acc, alpha, moved):
    """``acc * alpha`` per row of a 64 x 256 accumulator, the multiplies skipped by warps whose
    rows did not move (``lazy_max``: their ``alpha`` is 1, or 0 on rows that saw no key, whose
    ``acc`` is 0)."""
    gl.static_assert(acc.shape[1] == 256, "one thread's 128 values per asm")
    a = gl.broadcast(gl.expand_dims(alpha, 1), acc)[0]
    m = gl.broadcast(gl.expand_dims(moved, 1), acc)[0]
    return gl.inline_asm_elementwise(SKIP_ASM, SKIP_CONSTRAINTS, [acc, a, m], dtype=gl.float32, is_pure=False,
                                     pack=128)  # fmt: skip
