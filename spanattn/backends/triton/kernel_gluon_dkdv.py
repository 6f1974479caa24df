"""The backward's dK/dV pass in Gluon for Hopper at head_dim 128: kernel_dkdv.py's walk (one
program per key tile of the key schedule and KV head, the query tiles of the tile's column hull
for each query head of its GQA group in turn, FULL tiles unmasked, dK and dV summed over the
group inside the program: the same bits every call) laid out as the forward's kernel_gluon.py:
a one-warp producer streams each query tile's Q and dO by TMA into a ring of ``STAGES`` slots,
and two 4-warp consumers own 64 keys each of the 128-key tile (K and V loaded once into shared
memory). Per query tile a consumer issues ``s^T = K Q^T`` and ``dp^T = V dO^T`` (wgmma, operands
in shared memory), forms ``p`` and ``ds`` as bwd_scores.py says, then issues ``dV += p^T dO`` and
``dK += ds^T Q`` with ``p^T`` and ``ds^T`` from registers, which run under the next tile's wait and
the other consumer's math; a slot goes back once both consumers' products on it are done.

Isolation: a query tile that runs past its chunk's end (the walk's last) holds the next
sequence's rows; the producer zeroes them before the consumers may read them (a NaN there would
reach every key's dK and dV through ``0 * NaN`` in the products, however its scores are masked).
Keys past the sequence's end are rows of dK/dV of their own, never stored. Span groups are not
walked here (kernel_dkdv.py serves them).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .columns import (
    KEY_FULL_END,
    KEY_FULL_START,
    KEY_K_ROW0,
    KEY_KV_LEN,
    KEY_N_START,
    KEY_Q_END,
    KEY_Q_LEN,
    KEY_Q_ROW0,
    KEY_Q_START,
)
from .gluon_compat import partition_barrier, tma_load
from .gluon_parts import zero_rows_from

KEYS = gl.constexpr(64)  # keys per consumer warpgroup: wgmma's 64 rows
# Per head_dim: queries per step of the walk, keys per program, Q and dO slots. d128: 4 x 16 KB
# beside K and V's 64 KB; d256 (kernel_gluon_dkdv_split): 2 x 32 KB beside 64 KB and the score
# swap's 64 KB; d512 (the same): 2 x 32 KB beside 128 KB and 32 KB.
TILES = {128: (32, 128, 4), 256: (32, 64, 2), 512: (16, 64, 2)}
HEAD_DIMS = tuple(TILES)


@gluon.constexpr_function
def acc_layout(cols):
    """wgmma's accumulator layout of a consumer's (4 warps') 64-row tile ``cols`` wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def operand_layout(acc):
    """The layout of a 16-bit register A operand of a product into accumulator layout ``acc``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)


@gluon.jit
def slot_barriers(STAGES: gl.constexpr):
    """Each ring slot's ``ready`` (the producer's loads landed: one arrival with their bytes) and
    ``done`` (both consumers' products on it finished: two arrivals)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(done.index(i), count=2)
    return ready, done


@gluon.jit
def store_key_rows(dk, dv, DK, DV, k_row0, first, kv_len, kv_head, col0, stride_dkt, stride_dkh,
                   stride_dvt, stride_dvh):  # fmt: skip
    """``dk`` and ``dv`` (fp32, wgmma accumulators) as rows of keys ``first ...`` of the sequence
    at packed key row ``k_row0``, columns ``col0 ...``: every key row of the sequence is stored
    (zero where no query sees the key), none past its end."""
    layout: gl.constexpr = dk.type.layout
    keys = first + gl.arange(0, dk.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.expand_dims(col0 + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout)), 0)
    ok = gl.expand_dims(keys < kv_len, 1)
    rows = gl.expand_dims((k_row0 + keys).to(gl.int64), 1)
    gl.store(DK + rows * stride_dkt + kv_head * stride_dkh + cols, dk.to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + rows * stride_dvt + kv_head * stride_dvh + cols, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def tile_info(KEY_TILE_INFO, N_INFO: gl.constexpr, HKV: gl.constexpr, BLOCK_M: gl.constexpr,
              SPLITS: gl.constexpr = 1):  # fmt: skip
    """This program's key tile and KV head, its sequence and its query walk (columns.KEY_INFO):
    ``n_q`` query tiles from ``q_start``, FULL in ``[full_start, full_end)``. ``SPLITS``
    programs share a key tile and KV head (kernel_gluon_dkdv_split at d512): ``program_id %
    SPLITS`` is the program's share."""
    pid = gl.program_id(0) // SPLITS
    info = KEY_TILE_INFO + (pid // HKV) * N_INFO
    k_row0 = gl.load(info + KEY_K_ROW0)
    kv_len = gl.load(info + KEY_KV_LEN)
    n_start = gl.load(info + KEY_N_START)
    q_row0 = gl.load(info + KEY_Q_ROW0)
    q_len = gl.load(info + KEY_Q_LEN)
    q_start = gl.load(info + KEY_Q_START)
    q_end = gl.load(info + KEY_Q_END)
    full_start = gl.load(info + KEY_FULL_START)
    full_end = gl.load(info + KEY_FULL_END)
    n_q = (q_end - q_start + BLOCK_M - 1) // BLOCK_M
    return pid % HKV, k_row0, kv_len, n_start, q_row0, q_len, q_start, n_q, full_start, full_end


@gluon.jit
def produce_queries(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, done,
                    tail, KEY_TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols, kv_head_rows,
                    kv_head_cols, HKV: gl.constexpr, GROUP: gl.constexpr, N_INFO: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PIECES: gl.constexpr,
                    SPLITS: gl.constexpr):  # fmt: skip
    """The producer warp: the tile's K and V once, then Q and dO of each query tile of the walk,
    head by head, into slot ``c % STAGES`` once both consumers are done with the tile ``c -
    STAGES`` it held. Every tile as ``PIECES`` boxes of columns side by side (shared memory index
    ``slot * PIECES + piece``). ``*_head_rows``, ``*_head_cols``: how far a head moves in the TMA
    matrix (tma_layout)."""
    kv_head, k_row0, kv_len, n_start, q_row0, q_len, q_start, n_q, _, _ = tile_info(
        KEY_TILE_INFO, N_INFO, HKV, BLOCK_M, SPLITS
    )
    width: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(kv_bar, PIECES * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    kv_row = k_row0 + n_start + kv_head * kv_head_rows
    for i in gl.static_range(PIECES):
        tma_load(k_desc, [kv_row, kv_head * kv_head_cols + i * width], kv_bar, k_smem.index(i))
        tma_load(v_desc, [kv_row, kv_head * kv_head_cols + i * width], kv_bar, v_smem.index(i))
    tile_bytes: gl.constexpr = PIECES * (q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    c = 0
    ends = 0
    for h in range(GROUP):
        head = kv_head * GROUP + h
        for t in range(n_q):
            m = q_start + t * BLOCK_M
            slot = c % STAGES
            mbarrier.wait(done.index(slot), (c // STAGES - 1) & 1, pred=c >= STAGES)
            if m + BLOCK_M > q_len:  # rows past the chunk: zeroed before the consumers read them
                mbarrier.expect(tail, tile_bytes)
                _load_queries(q_desc, do_desc, q_smem, do_smem, tail, slot, q_row0 + m, head, q_head_rows,
                              q_head_cols, do_head_rows, do_head_cols, width, PIECES)  # fmt: skip
                mbarrier.wait(tail, ends & 1)
                ends += 1
                zero_rows_from(q_smem, slot, q_len - m, PIECES, BLOCK_M)
                zero_rows_from(do_smem, slot, q_len - m, PIECES, BLOCK_M)
                fence_async_shared()  # generic-proxy stores before the consumers' MMAs read them
                partition_barrier()
                mbarrier.arrive(ready.index(slot))
            else:
                mbarrier.expect(ready.index(slot), tile_bytes)
                _load_queries(q_desc, do_desc, q_smem, do_smem, ready.index(slot), slot, q_row0 + m,
                              head, q_head_rows, q_head_cols, do_head_rows, do_head_cols, width,
                              PIECES)  # fmt: skip
            c += 1


@gluon.jit
def _load_queries(q_desc, do_desc, q_smem, do_smem, bar, slot, row, head, q_head_rows, q_head_cols,
                  do_head_rows, do_head_cols, width: gl.constexpr, PIECES: gl.constexpr):  # fmt: skip
    """Q and dO of the query tile from packed row ``row`` of ``head`` into slot ``slot``."""
    for i in gl.static_range(PIECES):
        q_at = [row + head * q_head_rows, head * q_head_cols + i * width]
        do_at = [row + head * do_head_rows, head * do_head_cols + i * width]
        tma_load(q_desc, q_at, bar, q_smem.index(slot * PIECES + i))
        tma_load(do_desc, do_at, bar, do_smem.index(slot * PIECES + i))


@gluon.jit
def score_grads(s, dp, lse2, delta, qk_scale, softcap_log2, SOFTCAP: gl.constexpr):
    """bwd_scores.score_grads in Gluon: ``p`` and ``ds`` of a tile of raw scores, ``lse2`` and
    ``delta`` broadcast along the tile's keys (this kernel's tiles are transposed, kernel_gluon_dq's
    are not)."""
    if SOFTCAP:
        r = 2.0 / (gl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)
        p = gl.exp2((1.0 - r) * softcap_log2 - lse2)
        ds = p * (dp - delta) * (r * (2.0 - r))
    else:
        p = gl.exp2(s * qk_scale - lse2)
        ds = p * (dp - delta)
    return p, ds


@gluon.jit
def query_rows(c, n_q, kv_head, q_start, q_len, q_row0, offs_m, LSE2, DELTA, HQ: gl.constexpr,
          GROUP: gl.constexpr, BLOCK_M: gl.constexpr):  # fmt: skip
    """What tile ``c`` of the program's walk (query tile ``c % n_q`` of head ``c // n_q`` of the
    group) needs per query row: its first query, the rows' ``lse2`` and ``delta`` (zero past the
    chunk), and where they are (``rows``, ``row_ok``: tile_grads reads their intervals)."""
    h = c // n_q
    m = q_start + (c - h * n_q) * BLOCK_M
    head = kv_head * GROUP + h
    q_local = m + offs_m
    row_ok = q_local < q_len
    rows = q_row0 + gl.maximum(gl.minimum(q_local, q_len - 1), 0)  # a device plan's empty tile: q_len 0
    lse2 = gl.load(LSE2 + rows * HQ + head, mask=row_ok, other=0.0)
    delta = gl.load(DELTA + rows * HQ + head, mask=row_ok, other=0.0)
    return m, lse2, delta, rows, row_ok


@gluon.jit
def tile_grads(s, dp, m, lse2, delta, rows, row_ok, LO, HI, kv_idx, full_start, full_end, qk_scale,
               softcap_log2, a_layout: gl.constexpr, dtype: gl.constexpr, BLOCK_M: gl.constexpr,
               SOFTCAP: gl.constexpr):  # fmt: skip
    """``p^T`` and ``ds^T`` of one tile as the A operands of dV's and dK's products; masked
    outside the FULL query tiles by the rows' intervals, read there (a thread holds 16 of the
    tile's columns: per-query values cost 16 registers each; rows past the chunk see nothing)."""
    p, ds = score_grads(s, dp, gl.expand_dims(lse2, 0), gl.expand_dims(delta, 0), qk_scale, softcap_log2,
                        SOFTCAP)  # fmt: skip
    if (m < full_start) | (m + BLOCK_M > full_end):
        lo = gl.load(LO + rows)
        hi = gl.where(row_ok, gl.load(HI + rows), -1)
        k2 = gl.expand_dims(kv_idx, 1)
        allowed = (k2 >= gl.expand_dims(lo, 0)) & (k2 <= gl.expand_dims(hi, 0))
        p = gl.where(allowed, p, 0.0)
        ds = gl.where(allowed, ds, 0.0)
    return gl.convert_layout(p.to(dtype), a_layout), gl.convert_layout(ds.to(dtype), a_layout)


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, done, KEY_TILE_INFO,
             LSE2, DELTA, LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale,
             softcap_log2, scale, HQ: gl.constexpr, HKV: gl.constexpr, GROUP: gl.constexpr,
             N_INFO: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
             STAGES: gl.constexpr, SOFTCAP: gl.constexpr):  # fmt: skip
    """Keys ``PART * 64 ...`` of the tile: their dK and dV over the walk's ``GROUP * n_q`` tiles,
    stored at the end."""
    kv_head, k_row0, kv_len, n_start, q_row0, q_len, q_start, n_q, full_start, full_end = tile_info(
        KEY_TILE_INFO, N_INFO, HKV, BLOCK_M
    )
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = acc_layout(BLOCK_M)
    o_layout: gl.constexpr = acc_layout(HEAD_DIM)
    a_layout: gl.constexpr = operand_layout(o_layout)
    kv_idx = n_start + PART * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    k_part = k_smem.index(0).slice(PART * KEYS, KEYS)
    v_part = v_smem.index(0).slice(PART * KEYS, KEYS)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=o_layout)
    total = GROUP * n_q
    live = total > 0
    mbarrier.wait(kv_bar, 0)  # also with no walk: the loads land before the program ends
    # Tile c's dV, dK products are issued after tile c + 1's scores and run under its math: the
    # first tile's scores come alone, the last tile's products after the loop. No `if` around
    # them (ptxas serializes a pipeline's wgmma inside a branch): with no walk they run on
    # whatever the slots hold and are discarded.
    mbarrier.wait(ready.index(0), 0, pred=live)
    s = warpgroup_mma(k_part, q_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(v_part, do_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    m, lse2, delta, rows, row_ok = query_rows(0, gl.maximum(n_q, 1), kv_head, q_start, q_len, q_row0, offs_m,
                                              LSE2, DELTA, HQ, GROUP, BLOCK_M)  # fmt: skip
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=[s, dp])
    p_a, ds_a = tile_grads(s, dp, m, lse2, delta, rows, row_ok, LO, HI, kv_idx, full_start, full_end,
                           qk_scale, softcap_log2, a_layout, dtype, BLOCK_M, SOFTCAP)  # fmt: skip
    for c in range(1, total):
        slot = c % STAGES
        prev = (c - 1) % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        q = q_smem.index(slot)
        do = do_smem.index(slot)
        s = warpgroup_mma(k_part, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(v_part, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma(p_a, do_smem.index(prev), dv, is_async=True)
        dk = warpgroup_mma(ds_a, q_smem.index(prev), dk, is_async=True)
        m, lse2, delta, rows, row_ok = query_rows(c, n_q, kv_head, q_start, q_len, q_row0, offs_m, LSE2,
                                                  DELTA, HQ, GROUP, BLOCK_M)  # fmt: skip
        s, dp = warpgroup_mma_wait(num_outstanding=2, deps=[s, dp])
        p_a, ds_a = tile_grads(s, dp, m, lse2, delta, rows, row_ok, LO, HI, kv_idx, full_start, full_end,
                               qk_scale, softcap_log2, a_layout, dtype, BLOCK_M, SOFTCAP)  # fmt: skip
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
        mbarrier.arrive(done.index(prev))
    last = gl.maximum(total - 1, 0) % STAGES
    dv = warpgroup_mma(p_a, do_smem.index(last), dv, is_async=True)
    dk = warpgroup_mma(ds_a, q_smem.index(last), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
    dv = gl.where(live, dv, 0.0)
    dk = gl.where(live, dk, 0.0)
    store_key_rows(dk * scale, dv, DK, DV, k_row0, n_start + PART * KEYS, kv_len, kv_head, 0, stride_dkt,
                   stride_dkh, stride_dvt, stride_dvh)  # fmt: skip


@gluon.jit
def attn_bwd_dkdv_gluon(
    q_desc, do_desc, k_desc, v_desc, LSE2, DELTA, LO, HI, KEY_TILE_INFO, DK, DV, stride_dkt, stride_dkh,
    stride_dvt, stride_dvh, qk_scale, softcap_log2, scale, q_head_rows, q_head_cols, do_head_rows,
    do_head_cols, kv_head_rows, kv_head_cols, HQ: gl.constexpr, GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr,
    N_INFO: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    HKV: gl.constexpr = HQ // GROUP
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, 2 * KEYS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 2 * KEYS, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tail = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready, done = slot_barriers(STAGES)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(tail, count=1)
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, done, KEY_TILE_INFO, LSE2, DELTA,
                     LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, softcap_log2,
                     scale, HQ, HKV, GROUP, N_INFO, HEAD_DIM, BLOCK_M, STAGES, SOFTCAP)),
         (_consume, (1, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, done, KEY_TILE_INFO, LSE2, DELTA,
                     LO, HI, DK, DV, stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, softcap_log2,
                     scale, HQ, HKV, GROUP, N_INFO, HEAD_DIM, BLOCK_M, STAGES, SOFTCAP)),
         (produce_queries, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready,
                            done, tail, KEY_TILE_INFO, q_head_rows, q_head_cols, do_head_rows, do_head_cols,
                            kv_head_rows, kv_head_cols, HKV, GROUP, N_INFO, BLOCK_M, STAGES, 1, 1))],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on
