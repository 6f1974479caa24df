"""The Gluon prefill kernel for head_dim 512 on Hopper: a 64-query tile's head_dim split in halves
over two consumer warpgroups. A warpgroup's fp32 accumulator of 64 rows x 512 columns would take
all its registers, so each consumer owns the output columns of its half and computes its half of
every Q @ K^T product; the two halves of the scores are summed through shared memory (fp32
addition commutes, so both consumers hold bit-identical scores, row maxima and sums, with no
further exchange), and each runs P @ V for its columns. The scores are thus computed once, where
kernel.py's d512 configuration has two programs recompute them (1.5x the FLOPs). A warp whose
rows' maxima did not move skips the accumulator's rescale (gluon_rescale: 128 multiplies a
thread per 32-key tile; S5 6% faster on the H200). A named barrier of both consumers puts their
Q @ K^T ahead of either's P @ V on the tensor cores. Producer warp, K/V rings, deferred P @ V,
schedule, interval masks and the persistent launch's run-time deal as in kernel_gluon.py.
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
from .gluon_compat import partition_barrier
from .gluon_deal import deal_ring, take
from .gluon_parts import (
    consumer_start,
    last_pv,
    produce,
    q_operand,
    ring_barriers,
    scores,
    softmax_step,
    store_rows,
    tile_place,
    tile_walk,
)
from .gluon_pv_wait import wait_pv
from .gluon_rescale import rescale

ROWS = gl.constexpr(64)  # query rows per tile, held by both consumers
ZERO, TWO = gl.constexpr(0), gl.constexpr(2)
# Named barrier 8 over both consumers' 256 threads (triton's partitions use ids below 8): see
# _consume. The result only ties the statement into the dataflow.
_BOTH_SCORES_ISSUED = gl.constexpr("{ bar.sync 8, 256; mov.u32 $0, $1; }")


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, k_smem, v_smem, x_smem, q_bar, q_empty, k_ready, v_ready,
             done, x_full, items, full, free, OUT, LSE, LO, HI, QG, KG, KT,
             TILE_INFO, BT, stride_bt, WALK_INFO, num_items, section, qk_scale, softcap_log2,
             stride_ot, stride_oh, HQ: gl.constexpr, GROUP: gl.constexpr, N_INFO: gl.constexpr,
             HALF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             SOFTCAP: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
             GROUPS: gl.constexpr, CLAMP: gl.constexpr):  # fmt: skip
    """Columns ``PART * HALF ...`` of the 64 query rows of each work item the producer hands
    over; ``c`` counts the program's key tiles over all items (the ring's and the score swap's
    phases), ``i`` its items with key tiles (Q's phase), ``r`` all (the item ring's)."""
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(PART)
    # Half of Q in registers (gluon_parts.q_operand), in every variant: with it the paged and
    # span-group ones spill 0-8 bytes a thread more (40 where the span-group kernel on packed
    # K/V spilled none) and ran 4.0 / 3.4% faster on the H200 (S5 over 16-token pages, V1).
    c = 0
    i = 0
    r = 0
    item = take(items, full, free, r)
    while item < num_items:
        head, kv_head, q_row0, q_row_last, tma_row0, kv_len, kv_start, full_start, full_end, tma_last, \
            num_tiles, pages, n_pre, pre_start, n_main, post_start, _, _ = tile_walk(
                TILE_INFO, BT, stride_bt, WALK_INFO, item, num_items, section, 0, HQ, GROUP, N_INFO,
                BLOCK_N, PAGE, GROUPS)  # fmt: skip
        lo, hi, gsel, offs_n, m_i, l_i, alpha, acc, p, s_zero = consumer_start(
            LO, HI, QG, q_row0, q_row_last, dtype, ROWS, BLOCK_N, HALF, GROUPS
        )
        # The item's own rows, and whether a warp's maxima moved: gluon_rescale.
        own = q_row0 + gl.arange(0, ROWS, layout=m_i.type.layout) <= q_row_last
        moved = gl.zeros_like(alpha).to(gl.int32)
        live = num_tiles > 0  # predicated, not branched on: see kernel_gluon._consume
        mbarrier.wait(q_bar, i & 1, pred=live)
        q_a = q_operand(q, s_zero)
        for t in range(num_tiles):
            slot = (c + t) % STAGES
            before = c + gl.maximum(t - 1, 0)
            prev = before % STAGES
            n, ktg, outside = tile_place(
                t, KT + tma_row0, kv_start, n_pre, pre_start, n_main, post_start, kv_len, BLOCK_N, GROUPS
            )
            acc = rescale(acc, alpha, moved)
            mbarrier.wait(k_ready.index(slot), ((c + t) // STAGES) & 1)
            s = scores(q, q_a, k_smem.index(2 * slot + PART), s_zero, True)
            mbarrier.wait(v_ready.index(prev), (before // STAGES) & 1)
            # Both consumers' Q @ K^T go to the tensor cores before either's P @ V: the swap
            # below needs both halves, and a P @ V issued between them would delay the second
            # (S5 over 16-token pages 1.4% faster on the H200, packed even).
            gl.inline_asm_elementwise(_BOTH_SCORES_ISSUED, "=r,r", [c + t], dtype=gl.int32, is_pure=False,
                                      pack=1)  # fmt: skip
            acc = warpgroup_mma(p, v_smem.index(2 * prev + PART), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])

            # Swap halves of the scores, in the slots of this tile's parity: ours out, theirs in
            # once written. The partition barrier makes all 128 threads' stores happen before the
            # one thread that arrives signals them. Our slot is free again without a signal of its
            # own: the other consumer wrote its last tile's half (which we waited for) after it
            # had used what it read from our slot two tiles ago.
            x = (c + t) % 2
            x_smem.index(2 * PART + x).store(s)
            partition_barrier()
            mbarrier.arrive(x_full.index(2 * PART + x))
            mbarrier.wait(x_full.index(2 * (1 - PART) + x), ((c + t) // 2) & 1)
            s = s + x_smem.index(2 * (1 - PART) + x).load(s.type.layout)

            p, alpha, m_i, l_i, moved = softmax_step(
                s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
                softcap_log2, outside, gsel, KG + tma_row0, ktg, kv_len, own, BLOCK_N, SOFTCAP,
                GROUPS, CLAMP,
            )  # fmt: skip
            acc = wait_pv(acc, c + t)
            # This tile's keys and the previous tile's values are read (gluon_parts.ring_barriers).
            mbarrier.arrive(done.index(slot))

        mbarrier.arrive(q_empty, pred=live)  # as in kernel_gluon._consume
        last = gl.maximum(c + num_tiles - 1, 0)
        acc = last_pv(acc, alpha, p, v_smem.index(2 * (last % STAGES) + PART), v_ready, last, STAGES, live)
        # Both consumers hold the same row maxima and sums: one writes the LSE. Not the wide
        # stores of d256: at d512 (long walks) they ran S5 1.5% slower.
        store_rows(acc, m_i, l_i, OUT, LSE, q_row0, q_row_last, head, PART * HALF, stride_ot,
                   stride_oh, HQ, ROWS, RETURN_LSE and PART == 0, False)  # fmt: skip
        c += num_tiles
        i += live.to(gl.int32)
        r += 1
        item = take(items, full, free, r)


@gluon.jit(do_not_specialize=["last_page", "num_items", "section", "halves"])  # one compile whatever the step
def attn_fwd_gluon_split(
    q_desc, k_desc, v_desc, OUT, LSE, LO, HI, TILE_INFO, stride_ot, stride_oh, qk_scale,
    softcap_log2, q_head_rows, q_head_cols, kv_head_rows, kv_head_cols, BT, stride_bt, last_page,
    Q_GROUP, K_GROUP, KT_GROUP, WALK_INFO, num_items, DEAL, section, halves, WS,
    HQ: gl.constexpr, GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
    RETURN_LSE: gl.constexpr, N_INFO: gl.constexpr, PAGE: gl.constexpr, GROUPS: gl.constexpr,
    CLAMP: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    HALF: gl.constexpr = HEAD_DIM // 2
    dtype: gl.constexpr = q_desc.dtype
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], gl.float32)
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HALF], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_N, HALF], v_desc.layout)
    # Each consumer's score halves in two slots, alternating by key tile: one may store a tile's
    # half before the other has read its previous one, and a slot needs no release (_consume).
    x_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS, BLOCK_N], x_layout)
    q_bar, q_empty, v_loaded, k_ready, v_ready, done = ring_barriers(STAGES)
    items, full, free = deal_ring()
    x_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(x_full.index(i), count=1)  # by the consumer that wrote the half

    # Arguments written out in place (see kernel_gluon.attn_fwd_gluon). The producer reads Q as
    # two column halves and each K/V tile as two.
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, k_smem, v_smem, x_smem, q_bar, q_empty, k_ready, v_ready, done,
                     x_full, items, full, free, OUT, LSE, LO, HI, Q_GROUP, K_GROUP,
                     KT_GROUP, TILE_INFO, BT, stride_bt, WALK_INFO, num_items, section, qk_scale,
                     softcap_log2, stride_ot, stride_oh, HQ, GROUP, N_INFO, HALF, BLOCK_N, STAGES,
                     SOFTCAP, RETURN_LSE, PAGE, GROUPS, CLAMP)),
         (_consume, (1, q_smem, k_smem, v_smem, x_smem, q_bar, q_empty, k_ready, v_ready, done,
                     x_full, items, full, free, OUT, LSE, LO, HI, Q_GROUP, K_GROUP,
                     KT_GROUP, TILE_INFO, BT, stride_bt, WALK_INFO, num_items, section, qk_scale,
                     softcap_log2, stride_ot, stride_oh, HQ, GROUP, N_INFO, HALF, BLOCK_N, STAGES,
                     SOFTCAP, RETURN_LSE, PAGE, GROUPS, CLAMP)),
         (produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                    done, v_loaded, items, full, free, TILE_INFO, BT, stride_bt, last_page,
                    WALK_INFO, num_items, DEAL, section, halves, q_head_rows, q_head_cols, kv_head_rows,
                    kv_head_cols, HQ, GROUP, N_INFO, ZERO, HALF, TWO, BLOCK_N, STAGES, PAGE, GROUPS))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on


# A 64-query tile, Q and each K/V tile read as two column halves.
launch = functools.partial(parts.GluonLaunch, attn_fwd_gluon_split, ROWS.value, ROWS.value, 2)
