"""The backward's dQ pass in Gluon for Hopper at head_dim 512: kernel_gluon_dq.py's walk and
producer over 64-query tiles, with the head_dim split over the two consumer warpgroups (as the
forward's kernel_gluon_split.py): a warpgroup's fp32 dq of 64 rows x 512 would take all its
registers, so each consumer owns 256 columns. It computes its half of every key tile's ``Q K^T``
and ``dO V^T``, the two swap their halves through shared memory and add them (bit-identical
scores in both), and each adds ``ds K`` for its columns. Q and dO (128 KB) stay in shared memory
for the walk; 16-key tiles keep two K/V slots and the swap beside them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .kernel_gluon_dkdv import acc_layout, operand_layout, slot_barriers
from .kernel_gluon_dkdv_split import half_products, swap, swap_buffers
from .kernel_gluon_dq import ROWS, produce_keys, row_stats, store_rows, tile_ds, tile_info


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, q_bar,
             ready, done, TILE_INFO, LSE2, DELTA, LO, HI, DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2,
             scale, HQ: gl.constexpr, N_INFO: gl.constexpr, WIDTH: gl.constexpr, PIECES: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr):  # fmt: skip
    """Columns ``PART * PIECES // 2 * WIDTH ...`` of the tile's dq over the walk, stored at the
    end: two accumulators of ``WIDTH`` columns, one per shared-memory piece of K (d512: a
    consumer's two pieces)."""
    OWN: gl.constexpr = PIECES // 2
    head, q_row0, q_row_last, k_row0, kv_len, kv_start, n_tiles, full_start, full_end = tile_info(
        TILE_INFO, N_INFO, HQ, BLOCK_N
    )
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = acc_layout(BLOCK_N)
    o_layout: gl.constexpr = acc_layout(WIDTH)
    a_layout: gl.constexpr = operand_layout(o_layout)
    lo, hi, lse2, delta = row_stats(LO, HI, LSE2, DELTA, q_row0, q_row_last, head, s_layout, HQ)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    tma_last = kv_len - BLOCK_N
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dq0 = gl.zeros([ROWS, WIDTH], gl.float32, layout=o_layout)
    dq1 = gl.zeros([ROWS, WIDTH], gl.float32, layout=o_layout)
    first = PART * OWN
    mbarrier.wait(q_bar, 0)  # also with no walk: the loads land before the program ends
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        s = half_products(q_smem, k_smem, first, slot * PIECES + first, s_zero, OWN)
        dp = half_products(do_smem, v_smem, first, slot * PIECES + first, s_zero, OWN)
        s = warpgroup_mma_wait(num_outstanding=OWN, deps=[s])
        s = swap(s, s_smem, s_full, t, PART)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
        dp = swap(dp, dp_smem, dp_full, t, PART)
        ds_a = tile_ds(s, dp, kv_start + t * BLOCK_N, lo, hi, lse2, delta, offs_n, full_start, full_end,
                       tma_last, qk_scale, softcap_log2, a_layout, dtype, BLOCK_N, SOFTCAP)  # fmt: skip
        dq0 = warpgroup_mma(ds_a, k_smem.index(slot * PIECES + first), dq0, is_async=True)
        dq1 = warpgroup_mma(ds_a, k_smem.index(slot * PIECES + first + 1), dq1, is_async=True)
        dq0, dq1 = warpgroup_mma_wait(num_outstanding=0, deps=[dq0, dq1])
        mbarrier.arrive(done.index(slot))
    store_rows(dq0 * scale, DQ, q_row0, q_row_last, head, first * WIDTH, stride_dqt, stride_dqh)
    store_rows(dq1 * scale, DQ, q_row0, q_row_last, head, (first + 1) * WIDTH, stride_dqt, stride_dqh)


@gluon.jit
def attn_bwd_dq_gluon_split(
    q_desc, do_desc, k_desc, v_desc, LSE2, DELTA, LO, HI, TILE_INFO, DQ, stride_dqt, stride_dqh, qk_scale,
    softcap_log2, scale, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows, kv_head_cols,
    HQ: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, SOFTCAP: gl.constexpr, N_INFO: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    WIDTH: gl.constexpr = q_desc.block_type.shape[1]  # columns of a piece (128)
    PIECES: gl.constexpr = HEAD_DIM // WIDTH
    q_smem = gl.allocate_shared_memory(dtype, [PIECES, ROWS, WIDTH], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [PIECES, ROWS, WIDTH], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES * PIECES, BLOCK_N, WIDTH], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES * PIECES, BLOCK_N, WIDTH], v_desc.layout)
    s_smem, dp_smem, s_full, dp_full = swap_buffers(ROWS, BLOCK_N)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready, done = slot_barriers(STAGES)
    mbarrier.init(q_bar, count=1)
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, q_bar, ready, done,
                     TILE_INFO, LSE2, DELTA, LO, HI, DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2,
                     scale, HQ, N_INFO, WIDTH, PIECES, BLOCK_N, STAGES, SOFTCAP)),
         (_consume, (1, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, q_bar, ready, done,
                     TILE_INFO, LSE2, DELTA, LO, HI, DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2,
                     scale, HQ, N_INFO, WIDTH, PIECES, BLOCK_N, STAGES, SOFTCAP)),
         (produce_keys, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done,
                         TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows,
                         kv_head_cols, HQ, GROUP, N_INFO, BLOCK_N, STAGES, 1, PIECES))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
