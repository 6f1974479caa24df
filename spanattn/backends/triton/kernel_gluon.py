"""The prefill kernel in Gluon (Triton's explicit-layout dialect) for Hopper at head_dim 128 and
256 (512: kernel_gluon_split.py): the same tiles, schedule and interval masks as kernel.py, laid
out as FlashAttention-3 does it: a one-warp producer (gluon_parts.produce; packed K/V or the
pages of a paged cache) streams K and V tiles by TMA into two rings of ``STAGES`` shared-memory slots, and two
4-warp consumers (64 query rows each) run their softmax of a tile while the tensor cores do the
previous tile's P @ V (waited for after the softmax, where ptxas would not put it by itself:
gluon_pv_wait). No barrier couples the two consumers: each releases a slot by arriving on
a barrier of its own, so one consumer's softmax overlaps the other's MMAs as well. A consumer
releases slots once a tile, after the deferred P @ V: that tile's keys and the previous tile's
values (gluon_parts.ring_barriers), so that two stages keep the next tile's loads ahead of the
MMAs with one release, one warpgroup barrier, a tile. The launch is
persistent: one program per SM takes work items (query tile x head) as it goes (gluon_deal.py:
dealt at run time, in sections of KV heads whose K/V fit in L2), and the producer loads an
item's Q and first K/V tiles while the consumers finish the previous item's last softmax and
P @ V and store its rows: on short walks (a sliding window, a chunk of a few thousand keys)
those loads and stores weigh as much as several key tiles; an item's first tile runs Q @ K^T
and its softmax alone (no P @ V before it). The output's rescale for a tile's P @ V runs under
the Q @ K^T issued before it (_rescaled: d128 steps 1.4-2.1% faster than before the Q @ K^T on
an H100). At d256 a consumer skips those 128 multiplies a tile while none of its rows' maxima
moved by more than 2^8 (gluon_rescale); Q stays in shared memory (half of it in registers, as
d512 holds it, no longer pays there: see gluon_parts.q_operand). At d128 a short step's last
items run as two halves of their walks on two programs, merged by the half that ends second
(gluon_halves).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import gluon_parts as parts
from .gluon_deal import deal_ring, take
from .gluon_halves import merge_halves
from .gluon_parts import (
    consumer_start,
    last_pv,
    produce,
    ring_barriers,
    row_stats,
    scores,
    softmax_step,
    store_out,
    tile_place,
    tile_walk,
)
from .gluon_pv_wait import wait_pv

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup
ZERO, ONE = gl.constexpr(0), gl.constexpr(1)


@gluon.constexpr_function
def halves_tail(head_dim) -> bool:
    """Does a launch at ``head_dim`` take its last items in halves (gluon_halves)?"""
    return head_dim == 128


@gluon.jit
def _tile_scores(t, c, q, k_smem, k_ready, s_zero, KT, kv_start, n_pre, pre_start, n_main, post_start,
                 kv_len, live, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUPS: gl.constexpr):  # fmt: skip
    """Key tile ``t`` of an item's walk (``c``: the program's key tiles before the item): its
    first key, group code and place in the walk (read first: their latency hides under the
    MMAs), then Q @ K^T issued once the keys are in."""
    n, ktg, outside = tile_place(
        t, KT, kv_start, n_pre, pre_start, n_main, post_start, kv_len, BLOCK_N, GROUPS
    )
    slot = (c + t) % STAGES
    mbarrier.wait(k_ready.index(slot), ((c + t) // STAGES) & 1, pred=live)
    # All of Q from shared memory (no register half: gluon_parts.q_operand says why).
    return scores(q, q, k_smem.index(slot), s_zero, False), n, ktg, outside


@gluon.jit
def _rescaled(acc, alpha, moved, LAZY: gl.constexpr):
    """``acc`` times ``alpha`` per row; with ``LAZY`` only if ``moved`` (a warp of the warpgroup
    moved its rows' maxima: gluon_rescale; elsewhere ``alpha`` is exactly 1). Called behind the
    wait for the values of the P @ V it precedes, so that the multiplies run under the Q @ K^T
    issued before. ``alpha`` passes a volatile move first, which LLVM keeps behind the wait's
    asm: without it LLVM hoists the multiplies, pure arithmetic, ahead of the Q @ K^T (the PTX
    shows it); with it the SASS has them between the two issues (tools/kernel_lab/compile_stats.py
    counts them)."""
    alpha = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [alpha], dtype=gl.float32, is_pure=False,
                                      pack=1)  # fmt: skip
    if LAZY:
        if moved != 0:
            acc = acc * gl.expand_dims(alpha, 1)
    else:
        acc = acc * gl.expand_dims(alpha, 1)
    return acc


@gluon.jit
def _softmax(s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
             softcap_log2, outside, gsel, KG, ktg, kv_len, own, BLOCK_N: gl.constexpr,
             SOFTCAP: gl.constexpr, GROUPS: gl.constexpr, CLAMP: gl.constexpr,
             LAZY: gl.constexpr):  # fmt: skip
    """gluon_parts.softmax_step and whether the next tile rescales: with ``LAZY`` the maxima move
    as gluon_rescale says (per warp, by the item's ``own`` rows) and the rescale happens when
    any warp of the warpgroup moved (one cross-warp reduction a tile, off the softmax's path);
    without, always."""
    if LAZY:
        p, alpha, m_i, l_i, warps = softmax_step(
            s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
            softcap_log2, outside, gsel, KG, ktg, kv_len, own, BLOCK_N, SOFTCAP, GROUPS, CLAMP,
        )  # fmt: skip
        moved = gl.max(warps, 0)
    else:
        p, alpha, m_i, l_i = softmax_step(
            s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
            softcap_log2, outside, gsel, KG, ktg, kv_len, None, BLOCK_N, SOFTCAP, GROUPS, CLAMP,
        )  # fmt: skip
        moved = gl.to_tensor(1)
    return p, alpha, m_i, l_i, moved


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, done,
             items, full, free, OUT, LSE, LO, HI, QG, KG, KT, TILE_INFO, BT, stride_bt,
             WALK_INFO, num_items, section, halves, WS, FLAGS, qk_scale, softcap_log2, stride_ot, stride_oh,
             HQ: gl.constexpr, GROUP: gl.constexpr, N_INFO: gl.constexpr, HEAD_DIM: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
             RETURN_LSE: gl.constexpr, PAGE: gl.constexpr, GROUPS: gl.constexpr,
             CLAMP: gl.constexpr):  # fmt: skip
    """Query rows ``PART * 64 ...`` of each work item the producer hands over: the online
    softmax in the log2 domain (as in kernel._softmax), each tile's P @ V issued one tile late
    so that the next softmax runs under it: an item's first tile has Q @ K^T and softmax alone,
    its last tile's P @ V follows the loop. ``c`` counts the program's key tiles over all its
    items (the ring's slot and phase), ``i`` its items with key tiles (Q's phase), ``r`` all
    (the item ring's)."""
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(PART)
    LAZY: gl.constexpr = HEAD_DIM == 256
    # Halved items at d128 only: holding the other half's 64 x 256 accumulator beside its own
    # made d256 spill 3.4 KB a thread (and its short steps end evenly already: gluon_halves).
    HALVES: gl.constexpr = halves_tail(HEAD_DIM)
    c = 0
    i = 0
    r = 0
    item = take(items, full, free, r)
    while item < num_items:
        head, kv_head, q_row0, q_row_last, tma_row0, kv_len, kv_start, full_start, full_end, tma_last, \
            num_tiles, pages, n_pre, pre_start, n_main, post_start, half, pair = tile_walk(
                TILE_INFO, BT, stride_bt, WALK_INFO, item, num_items, section, halves, HQ, GROUP,
                N_INFO, BLOCK_N, PAGE, GROUPS)  # fmt: skip
        row0 = q_row0 + PART * ROWS
        lo, hi, gsel, offs_n, m_i, l_i, alpha, acc, p, s_zero = consumer_start(
            LO, HI, QG, row0, q_row_last, dtype, ROWS, BLOCK_N, HEAD_DIM, GROUPS
        )
        # No `if` around an item without key tiles (a device plan's empty tile: its rows end
        # before they start): ptxas serializes every wgmma of a pipeline inside a branch (C7513),
        # so such an item runs the same code with its barrier steps predicated off (its scores and
        # output are never stored).
        live = num_tiles > 0
        # The item's own rows (gluon_rescale: only they may move the maxima), and whether a warp
        # of the warpgroup moved its rows' maxima in the last tile (the rescale before the next).
        own = row0 + gl.arange(0, ROWS, layout=m_i.type.layout) <= q_row_last
        moved = gl.to_tensor(0)
        mbarrier.wait(q_bar, i & 1, pred=live)
        # The first key tile: Q @ K^T and softmax alone. In the loop its P @ V (of p = 0) cost
        # half a tile's MMAs per item: without it S1 d128 3.5% and V2 4.4% faster on the H200.
        s, n, ktg, outside = _tile_scores(
            0, c, q, k_smem, k_ready, s_zero, KT + tma_row0, kv_start, n_pre, pre_start, n_main,
            post_start, kv_len, live, STAGES, BLOCK_N, GROUPS,
        )  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        # Tile c's keys are read (and the last item's last values: gluon_parts.ring_barriers).
        mbarrier.arrive(done.index(c % STAGES), pred=live)
        p, alpha, m_i, l_i, moved = _softmax(
            s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
            softcap_log2, outside, gsel, KG + tma_row0, ktg, kv_len, own, BLOCK_N, SOFTCAP, GROUPS,
            CLAMP, LAZY,
        )  # fmt: skip
        for t in range(1, num_tiles):
            s, n, ktg, outside = _tile_scores(
                t, c, q, k_smem, k_ready, s_zero, KT + tma_row0, kv_start, n_pre, pre_start, n_main,
                post_start, kv_len, live, STAGES, BLOCK_N, GROUPS,
            )  # fmt: skip
            # The previous tile's P @ V, under this tile's softmax.
            prev = (c + t - 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((c + t - 1) // STAGES) & 1)
            acc = _rescaled(acc, alpha, moved, LAZY)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
            p, alpha, m_i, l_i, moved = _softmax(
                s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
                softcap_log2, outside, gsel, KG + tma_row0, ktg, kv_len, own, BLOCK_N, SOFTCAP,
                GROUPS, CLAMP, LAZY,
            )  # fmt: skip
            acc = wait_pv(acc, c + t)
            # This tile's keys and the previous tile's values are read: their slots go back.
            mbarrier.arrive(done.index((c + t) % STAGES))

        # The item's Q @ K^T are done: the next item's Q may load under the last P @ V and stores.
        # Released here rather than at the last Q @ K^T in the loop: Gluon puts a barrier of the
        # warpgroup's threads before each arrive, so a predicated arrive costs one every tile.
        mbarrier.arrive(q_empty, pred=live)
        last = gl.maximum(c + num_tiles - 1, 0)
        # The last values' slot goes back with the next item's first keys' (ring_barriers).
        acc = last_pv(acc, alpha, p, v_smem.index(last % STAGES), v_ready, last, STAGES, live)
        m_row, l_row = row_stats(acc, m_i, l_i)
        keep = None  # every row up to the sequence's last
        if HALVES:
            # Half a walk (gluon_halves): the half that ends second stores the rows. One store_out
            # for both kinds of item (one copy of its code).
            keep = gl.full([ROWS], 1, gl.int1, m_row.type.layout)
            if half >= 0:
                acc, m_row, l_row, keep = merge_halves(acc, m_row, l_row, live, WS, FLAGS, pair, half,
                                                       halves, PART * ROWS, ROWS)  # fmt: skip
        store_out(acc, m_row, l_row, OUT, LSE, row0, q_row_last, keep, head, 0, stride_ot, stride_oh, HQ,
                  ROWS, RETURN_LSE, True)  # fmt: skip
        c += num_tiles
        i += live.to(gl.int32)
        r += 1
        item = take(items, full, free, r)


@gluon.jit(do_not_specialize=["last_page", "num_items", "section", "halves"])  # one compile whatever the step
def attn_fwd_gluon(
    q_desc, k_desc, v_desc, OUT, LSE, LO, HI, TILE_INFO, stride_ot, stride_oh, qk_scale,
    softcap_log2, q_head_rows, q_head_cols, kv_head_rows, kv_head_cols, BT, stride_bt, last_page,
    Q_GROUP, K_GROUP, KT_GROUP, WALK_INFO, num_items, DEAL, section, halves, WS,
    HQ: gl.constexpr, GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
    RETURN_LSE: gl.constexpr, N_INFO: gl.constexpr, PAGE: gl.constexpr, GROUPS: gl.constexpr,
    CLAMP: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar, q_empty, v_loaded, k_ready, v_ready, done = ring_barriers(STAGES)
    items, full, free = deal_ring()
    FLAGS = DEAL + 2  # the halved items' flags follow the deal's counters

    # The partitions' arguments are written out in place: in Gluon's frontend (triton 3.6) a tuple
    # held in a variable or built by concatenation loses its constexprs, and ``*`` unpacking is
    # not supported. Each partition reads its items' rows of the schedule itself (tile_walk).
    # The producer reads Q as two row halves and K/V tiles as one box each.
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, done, items,
                     full, free, OUT, LSE, LO, HI, Q_GROUP, K_GROUP, KT_GROUP, TILE_INFO, BT,
                     stride_bt, WALK_INFO, num_items, section, halves, WS, FLAGS, qk_scale, softcap_log2,
                     stride_ot, stride_oh, HQ, GROUP, N_INFO, HEAD_DIM, BLOCK_N, STAGES, SOFTCAP, RETURN_LSE,
                     PAGE, GROUPS, CLAMP)),
         (_consume, (1, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, done, items,
                     full, free, OUT, LSE, LO, HI, Q_GROUP, K_GROUP, KT_GROUP, TILE_INFO, BT,
                     stride_bt, WALK_INFO, num_items, section, halves, WS, FLAGS, qk_scale, softcap_log2,
                     stride_ot, stride_oh, HQ, GROUP, N_INFO, HEAD_DIM, BLOCK_N, STAGES, SOFTCAP, RETURN_LSE,
                     PAGE, GROUPS, CLAMP)),
         (produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                    done, v_loaded, items, full, free, TILE_INFO, BT, stride_bt, last_page,
                    WALK_INFO, num_items, DEAL, section, halves, q_head_rows, q_head_cols, kv_head_rows,
                    kv_head_cols, HQ, GROUP, N_INFO, ROWS, ZERO, ONE, BLOCK_N, STAGES, PAGE, GROUPS))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on


# A 128-query tile, Q read as two 64-row boxes, each K/V tile as one box.
launch = functools.partial(
    parts.GluonLaunch, attn_fwd_gluon, 2 * ROWS.value, ROWS.value, 1, halve_tail=halves_tail
)
