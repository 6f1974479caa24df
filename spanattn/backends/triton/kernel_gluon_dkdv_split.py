"""The backward's dK/dV pass in Gluon for Hopper at head_dim 256 and 512: kernel_gluon_dkdv.py's
walk and producer, with a 64-key tile's head_dim split over the two consumer warpgroups (as the
forward's kernel_gluon_split.py splits d512). A warpgroup's fp32 dK and dV of 64 keys x 256
columns would take all its registers, so each consumer owns 128 columns: it computes its half
of every tile's ``K Q^T`` and ``V dO^T`` products, the two consumers swap their halves through
shared memory and add them (fp32 addition commutes: both hold bit-identical scores and score
gradients), and each runs the ``p^T dO`` and ``ds^T Q`` products for its columns. At d256 every
product is computed once. At d512 dK and dV of a key tile (256 KB in fp32, an SM's whole
register file) are split over two programs of 256 columns each, which both compute the full
scores: 1.5x the products, and 16-query steps so that K, V (128 KB), two slots of Q and dO and
the swap fit in shared memory.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_compat import partition_barrier
from .kernel_gluon_dkdv import (
    KEYS,
    acc_layout,
    operand_layout,
    produce_queries,
    query_rows,
    slot_barriers,
    store_key_rows,
    tile_grads,
    tile_info,
)


@gluon.jit
def swap_buffers(ROWS: gl.constexpr, COLS: gl.constexpr):
    """Each consumer's halves of the scores and of their gradients' ``V dO^T`` (``ROWS x COLS``
    fp32) in two slots, by tile parity, and the barriers that say a half is written (``swap``;
    one arrival, by the consumer that wrote it)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], gl.float32)
    s_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS, COLS], layout)
    dp_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS, COLS], layout)
    s_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    dp_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(s_full.index(i), count=1)
        mbarrier.init(dp_full.index(i), count=1)
    return s_smem, dp_smem, s_full, dp_full


@gluon.jit
def swap(x, x_smem, x_full, c, PART: gl.constexpr):
    """``x`` plus the other consumer's half of it for tile ``c`` (also kernel_gluon_dq_split's),
    through the slots of the tile's parity: ours out, theirs in once written (the partition
    barrier puts all 128 threads' stores before the one thread that arrives). Our slot needs no
    release: the other consumer wrote its half of tile ``c - 1`` (which we waited for) after it
    had read ours of tile ``c - 2``."""
    par = c % 2
    x_smem.index(2 * PART + par).store(x)
    partition_barrier()
    mbarrier.arrive(x_full.index(2 * PART + par))
    mbarrier.wait(x_full.index(2 * (1 - PART) + par), (c // 2) & 1)
    return x + x_smem.index(2 * (1 - PART) + par).load(x.type.layout)


@gluon.jit
def half_products(a_smem, b_smem, first_a, first_b, zero, OWN: gl.constexpr):
    """``sum_i a[first_a + i] @ b[first_b + i]^T`` over a consumer's ``OWN`` column pieces,
    issued asynchronously (also kernel_gluon_dq_split's)."""
    acc = warpgroup_mma(a_smem.index(first_a), b_smem.index(first_b).permute((1, 0)), zero, use_acc=False,
                        is_async=True)  # fmt: skip
    for i in gl.static_range(1, OWN):
        acc = warpgroup_mma(a_smem.index(first_a + i), b_smem.index(first_b + i).permute((1, 0)), acc,
                            is_async=True)  # fmt: skip
    return acc


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, kv_bar,
             ready, done, KEY_TILE_INFO, LSE2, DELTA, LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt,
             stride_dvh, qk_scale, softcap_log2, scale, HQ: gl.constexpr, HKV: gl.constexpr,
             GROUP: gl.constexpr, N_INFO: gl.constexpr, WIDTH: gl.constexpr, PIECES: gl.constexpr,
             BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr):  # fmt: skip
    """Columns of piece ``2 * share + PART`` (``WIDTH`` wide; ``share``: the program's of the
    tile's ``PIECES // 2``) of the tile's dK and dV over the walk's ``GROUP * n_q`` tiles,
    stored at the end; the scores summed over pieces ``PART * PIECES // 2 ...`` here and the
    rest by the other consumer."""
    SPLITS: gl.constexpr = PIECES // 2
    OWN: gl.constexpr = PIECES // 2  # contraction pieces per consumer
    kv_head, k_row0, kv_len, n_start, q_row0, q_len, q_start, n_q, full_start, full_end = tile_info(
        KEY_TILE_INFO, N_INFO, HKV, BLOCK_M, SPLITS
    )
    piece = 2 * (gl.program_id(0) % SPLITS) + PART
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = acc_layout(BLOCK_M)
    o_layout: gl.constexpr = acc_layout(WIDTH)
    a_layout: gl.constexpr = operand_layout(o_layout)
    kv_idx = n_start + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([KEYS, WIDTH], gl.float32, layout=o_layout)
    dv = gl.zeros([KEYS, WIDTH], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)  # also with no walk: the loads land before the program ends
    for c in range(GROUP * n_q):
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        first = slot * PIECES + PART * OWN
        s = half_products(k_smem, q_smem, PART * OWN, first, s_zero, OWN)
        dp = half_products(v_smem, do_smem, PART * OWN, first, s_zero, OWN)
        m, lse2, delta, rows, row_ok = query_rows(c, n_q, kv_head, q_start, q_len, q_row0, offs_m, LSE2,
                                                  DELTA, HQ, GROUP, BLOCK_M)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=OWN, deps=[s])
        s = swap(s, s_smem, s_full, c, PART)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
        dp = swap(dp, dp_smem, dp_full, c, PART)
        p_a, ds_a = tile_grads(s, dp, m, lse2, delta, rows, row_ok, LO, HI, kv_idx, full_start, full_end,
                               qk_scale, softcap_log2, a_layout, dtype, BLOCK_M, SOFTCAP)  # fmt: skip
        dv = warpgroup_mma(p_a, do_smem.index(slot * PIECES + piece), dv, is_async=True)
        dk = warpgroup_mma(ds_a, q_smem.index(slot * PIECES + piece), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
        mbarrier.arrive(done.index(slot))
    store_key_rows(dk * scale, dv, DK, DV, k_row0, n_start, kv_len, kv_head, piece * WIDTH, stride_dkt,
                   stride_dkh, stride_dvt, stride_dvh)  # fmt: skip


@gluon.jit
def attn_bwd_dkdv_gluon_split(
    q_desc, do_desc, k_desc, v_desc, LSE2, DELTA, LO, HI, KEY_TILE_INFO, DK, DV, stride_dkt, stride_dkh,
    stride_dvt, stride_dvh, qk_scale, softcap_log2, scale, q_head_rows, q_head_cols, do_head_rows,
    do_head_cols, kv_head_rows, kv_head_cols, HQ: gl.constexpr, GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
    N_INFO: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    HKV: gl.constexpr = HQ // GROUP
    WIDTH: gl.constexpr = q_desc.block_type.shape[1]  # columns of a piece (128)
    PIECES: gl.constexpr = HEAD_DIM // WIDTH
    q_smem = gl.allocate_shared_memory(dtype, [PIECES * STAGES, BLOCK_M, WIDTH], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [PIECES * STAGES, BLOCK_M, WIDTH], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [PIECES, KEYS, WIDTH], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [PIECES, KEYS, WIDTH], v_desc.layout)
    s_smem, dp_smem, s_full, dp_full = swap_buffers(KEYS, BLOCK_M)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tail = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready, done = slot_barriers(STAGES)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(tail, count=1)
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, kv_bar, ready,
                     done, KEY_TILE_INFO, LSE2, DELTA, LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt,
                     stride_dvh, qk_scale, softcap_log2, scale, HQ, HKV, GROUP, N_INFO, WIDTH, PIECES,
                     BLOCK_M, STAGES, SOFTCAP)),
         (_consume, (1, q_smem, do_smem, k_smem, v_smem, s_smem, dp_smem, s_full, dp_full, kv_bar, ready,
                     done, KEY_TILE_INFO, LSE2, DELTA, LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt,
                     stride_dvh, qk_scale, softcap_log2, scale, HQ, HKV, GROUP, N_INFO, WIDTH, PIECES,
                     BLOCK_M, STAGES, SOFTCAP)),
         (produce_queries, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready,
                            done, tail, KEY_TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols,
                            kv_head_rows, kv_head_cols, HKV, GROUP, N_INFO, BLOCK_M, STAGES, PIECES,
                            PIECES // 2))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
