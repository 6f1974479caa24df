"""The last items of a persistent Gluon launch walked in two halves on two programs (Hopper), so
that a short step's launch ends on items half as long.

Programs take items heaviest first (gluon_deal.py), so the last round is the lightest, but its
items are whole walks: when a step holds a few items per SM (S4: 8.7), the programs that take
the last ones run on for most of an item while the others have nothing left (the H200's SMs
sat idle 6.2% of S4's time, FA4's kernel 2.8%:
results/2026-12-02-kernel-counters-s3-s4-h200.json). On such steps (``halved_items``) the last
``halves`` items of the deal order become two units each, one per half of the item's key tiles
(the first half has the extra tile); each unit computes its half as an item would, writes its
unnormalized output, row maxima and row sums to a scratch buffer (``partials_numel``), and
the half that finishes second reads the other's and stores the merged rows. Per warp (16
rows): the warp's arrival on its flag (an atomic increment that wraps to zero at the second
arrival, so flags are zero again for the next launch and CUDA-graph replays) says whether the
other half's warp had written its rows. The merge takes the first half's values, then the
second's, whichever program runs it: the same operations on the same numbers, so outputs stay
bit-identical from run to run and between persistent and one-program-per-item launches (which
halve the same items).

Used by kernel_gluon.py at head_dim 128 on steps without span groups; ``halves`` is 0
elsewhere (d256, the d512 kernel, span-group walks), where every unit is a whole item.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A warp's arrival on its flag: each thread's partial rows made visible (fence), the warp met,
# one lane's increment (acquire-release, GPU scope; ``inc`` with bound 1 wraps the second
# arrival back to zero), the count it found shared with the warp, the other half's rows made
# readable. One call per thread (``pack=2``: a thread holds two rows of wgmma's layout).
_ARRIVE = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l; fence.acq_rel.gpu; bar.warp.sync -1; mov.u32 l, %laneid; "
    "setp.eq.u32 p, l, 0; mov.b32 $0, 0; @p atom.acq_rel.gpu.global.inc.u32 $0, [$2], 1; "
    "shfl.sync.idx.b32 $0, $0, 0, 31, -1; bar.warp.sync -1; fence.acq_rel.gpu; mov.b32 $1, $0; }"
)
HALVE_BELOW = 16  # items a program from which a launch's items stay whole
ROWS_PER_ITEM = gl.constexpr(128)
WARPS_PER_ITEM = gl.constexpr(8)  # two consumer warpgroups


def halved_items(items: int, programs: int) -> int:
    """How many of a launch's last items run in halves: half a round of the SMs' programs, all
    items when the step has fewer, none from 16 items a program on. A launch's tail costs about
    half its last items' time, 1 / (2 x items per program) of the step; halving costs each
    halved item one more Q load, first tile, store and the partial rows' trip through L2. A CPU
    model of the deal (items' times jittered by 10%) put S4 (8.7 items a program) at 1.03x a
    perfect split with 33-66 halved items, 1.06x with none; on the H200 S4 took 0.4-3.7% less
    time, S1 d128 (31 items a program) 1.1-1.3% more, so steps with that many are left whole.

    >>> halved_items(1152, 132), halved_items(40, 132), halved_items(4096, 132)
    (66, 40, 0)
    """
    if items >= HALVE_BELOW * programs:
        return 0
    return min(items, programs // 2)


def partials_numel(halves: int, head_dim: int) -> int:
    """fp32 values of the scratch buffer: per halved item and half, 128 rows of ``head_dim``
    unnormalized outputs, then per row its maximum and sum (at least one value). A launch keeps
    one per stream it runs on: 8.8 MB for 66 halved items at d128 (132 SMs).

    >>> partials_numel(66, 128) * 4 / 1e6, partials_numel(0, 128)
    (8.78592, 1)
    """
    return max(halves * 2 * 128 * (head_dim + 2), 1)


@gluon.jit
def unit_item(unit, num_units, halves):
    """Deal unit ``unit``'s item (of ``num_units - halves``), which half of its walk it takes
    (-1: all of it) and its halved item's index (the scratch slot and flags)."""
    first = num_units - 2 * halves  # units before the halved items
    j = gl.maximum(unit - first, 0)
    halved = unit >= first
    return gl.where(halved, first + j // 2, unit), gl.where(halved, j % 2, -1), j // 2


@gluon.jit
def halve_walk(kv_start, n_main, half, BLOCK_N: gl.constexpr):
    """The interval walk's first key and key tiles for ``half`` (0: the first ``ceil(n / 2)``
    tiles, 1: the rest, -1: all)."""
    first = (n_main + 1) // 2
    kv_start = kv_start + gl.where(half == 1, first * BLOCK_N, 0)
    n_main = gl.where(half == 0, first, gl.where(half == 1, n_main - first, n_main))
    return kv_start, n_main


@gluon.jit
def _merge(acc_a, m_a, l_a, acc_b, m_b, l_b):
    """Two halves' unnormalized rows (log2-domain maxima, row sums) as one: ``a`` the first half."""
    m = gl.maximum(m_a, m_b)
    m_use = gl.where(m == float("-inf"), 0.0, m)  # rows that saw no key in either half
    w_a = gl.exp2(m_a - m_use)
    w_b = gl.exp2(m_b - m_use)
    acc = gl.fma(acc_a, gl.expand_dims(w_a, 1), acc_b * gl.expand_dims(w_b, 1))
    return acc, m, gl.fma(l_a, w_a, l_b * w_b)


@gluon.jit
def merge_halves(acc, m_row, l_row, live, WS, FLAGS, pair, half, halves, row_in_item,
                 ROWS: gl.constexpr):  # fmt: skip
    """A consumer's rows of a halved item (``row_in_item``: its first row within the item's
    128): its half's accumulator ``acc``, row maxima ``m_row`` and sums ``l_row`` (in the
    accumulator's row layout) written to slot ``pair`` of ``WS``, the warp's arrival on its
    flag, and where the other half's warp had arrived first, the merged rows. Returns the
    merged accumulator, maxima and sums, and which rows are this consumer's to store."""
    o_layout: gl.constexpr = acc.type.layout
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    D: gl.constexpr = acc.shape[1]
    # A half without key tiles computed nothing: its last P @ V multiplied zeros with whatever
    # the V slot held (NaN * 0 is NaN).
    acc = gl.where(live, acc, 0.0)
    m_row = gl.where(live, m_row, float("-inf"))
    l_row = gl.where(live, l_row, 0.0)
    r = row_in_item + gl.arange(0, ROWS, layout=rows_o)
    cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)), 0)
    ml = WS + halves * 2 * ROWS_PER_ITEM * D  # maxima and sums after every slot's outputs
    mine = (pair * 2 + half) * ROWS_PER_ITEM + r
    gl.store(WS + gl.expand_dims(mine.to(gl.int64) * D, 1) + cols, acc)
    gl.store(ml + mine * 2, m_row)
    gl.store(ml + mine * 2 + 1, l_row)
    flag = FLAGS + pair * WARPS_PER_ITEM + r // 16  # wgmma's layout: warp w holds rows 16w ...
    before = gl.inline_asm_elementwise(_ARRIVE, "=r,=r,l,l", [flag], dtype=gl.int32, is_pure=False, pack=2)
    second = before != 0
    theirs = (pair * 2 + 1 - half) * ROWS_PER_ITEM + r
    # L2, not L1: another SM wrote them
    acc_o = gl.load(WS + gl.expand_dims(theirs.to(gl.int64) * D, 1) + cols, mask=gl.expand_dims(second, 1),
                    other=0.0, cache_modifier=".cg")  # fmt: skip
    m_o = gl.load(ml + theirs * 2, mask=second, other=float("-inf"), cache_modifier=".cg")
    l_o = gl.load(ml + theirs * 2 + 1, mask=second, other=0.0, cache_modifier=".cg")
    # The first half's values, then the second's (selected, not branched: one copy of the code).
    first = half == 0
    acc, m_row, l_row = _merge(
        gl.where(first, acc, acc_o), gl.where(first, m_row, m_o), gl.where(first, l_row, l_o),
        gl.where(first, acc_o, acc), gl.where(first, m_o, m_row), gl.where(first, l_o, l_row),
    )  # fmt: skip
    return acc, m_row, l_row, second
