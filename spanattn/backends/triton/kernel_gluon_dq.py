"""The backward's dQ pass in Gluon for Hopper at head_dim 128 and 256: kernel_dq.py's walk (one
program per 128-query tile of the forward's schedule and query head, the key tiles the forward
walks, FULL tiles unmasked; each dQ element written by one program) laid out as the forward's
kernel_gluon.py: a one-warp producer loads the tile's Q and dO once and streams K and V tiles by
TMA into a ring of ``STAGES`` slots, and two 4-warp consumers own 64 query rows each. Per key
tile a consumer issues ``s = Q K^T`` and ``dp = dO V^T`` (wgmma, operands in shared memory),
forms ``ds`` as bwd_scores.py says and issues ``dq += ds K`` with ``ds`` from registers; a slot
goes back once both consumers' products on it are done.

Isolation as the forward's: the key tile across the sequence's end is read shifted back to end
with it (its keys below the tile's first are masked: seen already), so no key of another
sequence enters a product, which needs every sequence at least a key tile long (the caller
checks); query rows past the sequence's end are rows of dq of their own, never stored. Span
groups are not walked here (kernel_dq.py serves them).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .columns import FULL_END, FULL_START, K_ROW0, KV_END, KV_LEN, KV_START, Q_ROW0, Q_ROW_LAST
from .gluon_compat import tma_load
from .gluon_parts import in_interval
from .kernel_gluon_dkdv import acc_layout, operand_layout, score_grads, slot_barriers

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup
# Per head_dim: queries per program, keys per tile, K and V slots. d128: Q and dO's 64 KB and
# 3 x 32 KB; d256: 128 KB and 2 x 32 KB; d512 (kernel_gluon_dq_split, both consumers on one
# 64-query tile): 128 KB, 2 x 32 KB and the score swap's 32 KB.
TILES = {128: (128, 64, 3), 256: (128, 32, 2), 512: (64, 16, 2)}
HEAD_DIMS = tuple(TILES)


@gluon.jit
def tile_info(TILE_INFO, N_INFO: gl.constexpr, HQ: gl.constexpr, BLOCK_N: gl.constexpr):
    """This program's query tile and head, and its walk (columns.INFO): ``n_tiles`` key tiles
    from ``kv_start``, FULL in ``[full_start, full_end)``, the last read from ``tma_last``."""
    pid = gl.program_id(0)
    info = TILE_INFO + (pid // HQ) * N_INFO
    q_row0 = gl.load(info + Q_ROW0)
    q_row_last = gl.load(info + Q_ROW_LAST)
    k_row0 = gl.load(info + K_ROW0)
    kv_len = gl.load(info + KV_LEN)
    kv_start = gl.load(info + KV_START)
    kv_end = gl.load(info + KV_END)
    full_start = gl.load(info + FULL_START)
    full_end = gl.load(info + FULL_END)
    n_tiles = (kv_end - kv_start + BLOCK_N - 1) // BLOCK_N
    return pid % HQ, q_row0, q_row_last, k_row0, kv_len, kv_start, n_tiles, full_start, full_end


@gluon.jit
def row_stats(LO, HI, LSE2, DELTA, row0, q_row_last, head, s_layout: gl.constexpr, HQ: gl.constexpr):
    """The interval, ``lse2`` and ``delta`` of a consumer's 64 rows from ``row0`` (the last two
    broadcast along a tile's keys). Rows past the sequence's end copy its last row's (as the
    forward's): finite work on rows never stored; a program with no walk reads row 0's."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    q_idx = gl.maximum(gl.minimum(rows, q_row_last), 0)
    lse2 = gl.expand_dims(gl.load(LSE2 + q_idx * HQ + head), 1)
    delta = gl.expand_dims(gl.load(DELTA + q_idx * HQ + head), 1)
    return gl.load(LO + q_idx), gl.load(HI + q_idx), lse2, delta


@gluon.jit
def store_rows(dq, DQ, row0, q_row_last, head, col0, stride_dqt, stride_dqh):
    """``dq`` (fp32, a wgmma accumulator) as rows ``row0 ...`` up to ``q_row_last`` of ``head``,
    columns ``col0 ...``."""
    layout: gl.constexpr = dq.type.layout
    rows = row0 + gl.arange(0, dq.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.expand_dims(col0 + gl.arange(0, dq.shape[1], layout=gl.SliceLayout(0, layout)), 0)
    ptrs = DQ + gl.expand_dims(rows.to(gl.int64) * stride_dqt, 1) + head * stride_dqh + cols
    gl.store(ptrs, dq.to(DQ.dtype.element_ty), mask=gl.expand_dims(rows <= q_row_last, 1))


@gluon.jit
def produce_keys(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done,
                 TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows, kv_head_cols,
                 HQ: gl.constexpr, GROUP: gl.constexpr, N_INFO: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, ROW_BOXES: gl.constexpr, PIECES: gl.constexpr):  # fmt: skip
    """The producer warp: Q and dO of the tile (``ROW_BOXES`` boxes of 64 rows, each as
    ``PIECES`` boxes of columns: shared memory index ``box * PIECES + piece``), then K and V tile
    ``t`` of the walk (as ``PIECES`` boxes, index ``slot * PIECES + piece``) into slot ``t %
    STAGES`` once both consumers are done with tile ``t - STAGES``. Rows of Q and dO past the
    sequence's end are the next rows (never stored)."""
    head, q_row0, _, k_row0, kv_len, kv_start, n_tiles, _, _ = tile_info(TILE_INFO, N_INFO, HQ, BLOCK_N)
    width: gl.constexpr = k_desc.block_type.shape[1]
    boxes: gl.constexpr = ROW_BOXES * PIECES
    mbarrier.expect(q_bar, boxes * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
    for j in gl.static_range(ROW_BOXES):
        row = q_row0 + j * ROWS
        for i in gl.static_range(PIECES):
            q_at = [row + head * q_head_rows, head * q_head_cols + i * width]
            do_at = [row + head * do_head_rows, head * do_head_cols + i * width]
            tma_load(q_desc, q_at, q_bar, q_smem.index(j * PIECES + i))
            tma_load(do_desc, do_at, q_bar, do_smem.index(j * PIECES + i))
    kv_head = head // GROUP
    kv_row = k_row0 + kv_head * kv_head_rows
    tile_bytes: gl.constexpr = PIECES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(done.index(slot), (t // STAGES - 1) & 1, pred=t >= STAGES)
        # the tile across the sequence's end shifted back to end with it
        row = kv_row + gl.minimum(kv_start + t * BLOCK_N, kv_len - BLOCK_N)
        mbarrier.expect(ready.index(slot), tile_bytes)
        for i in gl.static_range(PIECES):
            at = [row, kv_head * kv_head_cols + i * width]
            tma_load(k_desc, at, ready.index(slot), k_smem.index(slot * PIECES + i))
            tma_load(v_desc, at, ready.index(slot), v_smem.index(slot * PIECES + i))


@gluon.jit
def tile_ds(s, dp, n, lo, hi, lse2, delta, offs_n, full_start, full_end, tma_last, qk_scale, softcap_log2,
        a_layout: gl.constexpr, dtype: gl.constexpr, BLOCK_N: gl.constexpr,
        SOFTCAP: gl.constexpr):  # fmt: skip
    """``ds`` of key tile ``n ...`` as the A operand of its dq product, masked outside the FULL
    tiles (the shifted last tile by its true key indices)."""
    _, ds = score_grads(s, dp, lse2, delta, qk_scale, softcap_log2, SOFTCAP)
    if (n < full_start) | (n + BLOCK_N > full_end):
        ds = gl.where(in_interval(n, lo, hi, offs_n, tma_last), ds, 0.0)
    return gl.convert_layout(ds.to(dtype), a_layout)


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done, TILE_INFO, LSE2,
             DELTA, LO, HI, DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2, scale, HQ: gl.constexpr,
             N_INFO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             SOFTCAP: gl.constexpr):  # fmt: skip
    """Query rows ``PART * 64 ...`` of the tile: their dq over the walk, stored at the end."""
    head, q_row0, q_row_last, k_row0, kv_len, kv_start, n_tiles, full_start, full_end = tile_info(
        TILE_INFO, N_INFO, HQ, BLOCK_N
    )
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = acc_layout(BLOCK_N)
    o_layout: gl.constexpr = acc_layout(HEAD_DIM)
    a_layout: gl.constexpr = operand_layout(o_layout)
    lo, hi, lse2, delta = row_stats(LO, HI, LSE2, DELTA, q_row0 + PART * ROWS, q_row_last, head, s_layout, HQ)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    tma_last = kv_len - BLOCK_N
    q = q_smem.index(PART)
    do = do_smem.index(PART)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    live = n_tiles > 0
    mbarrier.wait(q_bar, 0)  # also with no walk: the loads land before the program ends
    # Tile t's dq product is issued after tile t + 1's scores and runs under its math (as the
    # forward's P @ V): the first tile's scores come alone, the last product after the loop, with
    # no `if` around them (ptxas serializes a pipeline's wgmma inside a branch): with no walk they
    # run on whatever the slots hold and are discarded.
    mbarrier.wait(ready.index(0), 0, pred=live)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=[s, dp])
    ds_a = tile_ds(s, dp, kv_start, lo, hi, lse2, delta, offs_n, full_start, full_end, tma_last, qk_scale,
               softcap_log2, a_layout, dtype, BLOCK_N, SOFTCAP)  # fmt: skip
    for t in range(1, n_tiles):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_a, k_smem.index(prev), dq, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=[s, dp])
        ds_a = tile_ds(s, dp, kv_start + t * BLOCK_N, lo, hi, lse2, delta, offs_n, full_start, full_end,
                       tma_last, qk_scale, softcap_log2, a_layout, dtype, BLOCK_N, SOFTCAP)  # fmt: skip
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
        mbarrier.arrive(done.index(prev))
    last = gl.maximum(n_tiles - 1, 0) % STAGES
    dq = warpgroup_mma(ds_a, k_smem.index(last), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    dq = gl.where(live, dq, 0.0)
    store_rows(dq * scale, DQ, q_row0 + PART * ROWS, q_row_last, head, 0, stride_dqt, stride_dqh)


@gluon.jit
def attn_bwd_dq_gluon(
    q_desc, do_desc, k_desc, v_desc, LSE2, DELTA, LO, HI, TILE_INFO, DQ, stride_dqt, stride_dqh, qk_scale,
    softcap_log2, scale, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows, kv_head_cols,
    HQ: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, SOFTCAP: gl.constexpr, N_INFO: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready, done = slot_barriers(STAGES)
    mbarrier.init(q_bar, count=1)
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done, TILE_INFO, LSE2, DELTA, LO, HI,
                     DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2, scale, HQ, N_INFO, HEAD_DIM, BLOCK_N,
                     STAGES, SOFTCAP)),
         (_consume, (1, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done, TILE_INFO, LSE2, DELTA, LO, HI,
                     DQ, stride_dqt, stride_dqh, qk_scale, softcap_log2, scale, HQ, N_INFO, HEAD_DIM, BLOCK_N,
                     STAGES, SOFTCAP)),
         (produce_keys, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, ready, done,
                         TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows,
                         kv_head_cols, HQ, GROUP, N_INFO, BLOCK_N, STAGES, 2, 1))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
