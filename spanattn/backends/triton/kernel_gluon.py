"""The prefill kernel in Gluon (Triton's explicit-layout dialect) for Hopper: the same tiles,
schedule and interval masks as kernel.py, laid out as FlashAttention-3 does it: a one-warp
producer streams K and V tiles by TMA into two rings of ``STAGES`` shared-memory slots, and two
4-warp consumers (64 query rows each) run their softmax of a tile while the tensor cores do the
previous tile's P @ V. No barrier couples the two consumers: each releases a slot by arriving on
its ``empty`` barrier, so one consumer's softmax overlaps the other's MMAs as well. K and V
slots are released apart: a K slot as soon as its scores are computed, a V slot after the
deferred P @ V, so that two stages keep the next tile's loads ahead of the MMAs.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .columns import FULL_END, FULL_START, K_ROW0, KV_END, KV_LEN, KV_START, Q_ROW0, Q_ROW_LAST

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup
# Triton versions this kernel was checked on, on an H200. Gluon is experimental and changes
# between releases (triton 3.9 renamed the TMA copy); it compiles for sm_90 on 3.9 as well
# (tests/test_kernels_compile.py), but runs there only when asked (SPANATTN_TRITON_GLUON=1).
CHECKED_TRITON = ("3.6.",)


def checked_triton() -> bool:
    """Is the installed triton one this kernel was checked on?"""
    return triton.__version__.startswith(CHECKED_TRITON)


# TMA's global-to-shared copy: ``async_copy_global_to_shared`` in triton 3.6, ``async_load`` later.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
             v_empty, q_row0, head, num_tiles, kv_start, tma_row0, tma_last, col,
             HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """Q once, then K (V) tile ``t`` into K (V) slot ``t % STAGES`` as soon as both consumers
    released the tile that held it before. The tile across the sequence end is read shifted back
    to end with the sequence; Q rows past it read the next rows (never stored)."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, [q_row0, head * HEAD_DIM], q_bar, q_smem.index(0))
    tma_load(q_desc, [q_row0 + ROWS, head * HEAD_DIM], q_bar, q_smem.index(1))
    for t in range(num_tiles):
        slot = t % STAGES
        reuse = (t // STAGES - 1) & 1
        row = tma_row0 + gl.minimum(kv_start + t * BLOCK_N, tma_last)
        mbarrier.wait(k_empty.index(slot), reuse, pred=t >= STAGES)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma_load(k_desc, [row, col], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), reuse, pred=t >= STAGES)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [row, col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _consume(PART: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
             v_empty, OUT, LSE, LO, HI, q_row0, q_row_last, head, num_tiles, kv_start, full_start,
             full_end, tma_last, qk_scale, softcap_log2, stride_ot, stride_oh, HQ: gl.constexpr,
             HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             SOFTCAP: gl.constexpr, RETURN_LSE: gl.constexpr):  # fmt: skip
    """Query rows ``PART * 64 ...`` of the tile: the online softmax in the log2 domain (as in
    kernel._softmax), each tile's P @ V issued one tile late so that the next softmax runs
    under it."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = q_row0 + PART * ROWS
    # Rows past the sequence end copy the last row's interval (as in kernel.py).
    q_idx = gl.minimum(row0 + gl.arange(0, ROWS, layout=rows_s), q_row_last)
    lo = gl.load(LO + q_idx)
    hi = gl.load(HI + q_idx)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
    alpha = gl.full([ROWS], 1.0, gl.float32, layout=rows_o)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    p = gl.zeros([ROWS, BLOCK_N], dtype, layout=p_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(PART)
    mbarrier.wait(q_bar, 0)

    for t in range(num_tiles):
        slot = t % STAGES
        prev = gl.maximum(t - 1, 0) % STAGES
        n = kv_start + t * BLOCK_N
        # Rescaled before any MMA is in flight: ptxas would wait for them before reading acc.
        acc = acc * gl.expand_dims(alpha, 1)
        mbarrier.wait(k_ready.index(slot), (t // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # The previous tile's P @ V (at the first tile p = 0 against its own values).
        mbarrier.wait(v_ready.index(prev), (gl.maximum(t - 1, 0) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
        mbarrier.arrive(k_empty.index(slot))

        if SOFTCAP:  # c * tanh(score * scale / c), in log2 units (see kernel._softmax)
            s = (1.0 - 2.0 / (gl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)) * softcap_log2
            s_scale = 1.0
        else:
            s_scale = qk_scale
        if (n < full_start) | (n + BLOCK_N > full_end):
            kv_idx = gl.expand_dims(gl.minimum(n, tma_last) + offs_n, 0)
            keep = (kv_idx >= gl.expand_dims(gl.maximum(lo, n), 1)) & (kv_idx <= gl.expand_dims(hi, 1))
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * s_scale)
        # A row may have no allowed key in this tile and none seen yet.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p_f = gl.exp2(s * s_scale - gl.expand_dims(m_use, 1))
        alpha_s = gl.exp2(m_i - m_use)
        l_i = l_i * alpha_s + gl.sum(p_f, 1)
        m_i = m_new
        alpha = gl.convert_layout(alpha_s, rows_o)
        p = gl.convert_layout(p_f.to(dtype), p_layout)

        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        # The previous tile's values are read: hand its slot back to the producer.
        mbarrier.arrive(v_empty.index(prev), pred=t > 0)

    acc = acc * gl.expand_dims(alpha, 1)
    last = num_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    # Every row allows k = q, so l_i > 0 for stored rows.
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, rows_o), 1)
    rows = row0 + gl.arange(0, ROWS, layout=rows_o)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    o_rows = gl.expand_dims(rows.to(gl.int64) * stride_ot, 1)
    o_ptrs = OUT + o_rows + head * stride_oh + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, acc.to(dtype), mask=gl.expand_dims(rows <= q_row_last, 1))
    if RETURN_LSE:
        rows_l = row0 + gl.arange(0, ROWS, layout=rows_s)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # ln 2
        gl.store(LSE + rows_l.to(gl.int64) * HQ + head, lse, mask=rows_l <= q_row_last)


@gluon.jit
def attn_fwd_gluon(
    q_desc, k_desc, v_desc, OUT, LSE, LO, HI, TILE_INFO, stride_ot, stride_oh, qk_scale,
    softcap_log2, HQ: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr, RETURN_LSE: gl.constexpr,
    N_INFO: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    tile = pid // HQ
    head = pid % HQ
    info = TILE_INFO + tile * N_INFO
    q_row0 = gl.load(info + Q_ROW0)
    q_row_last = gl.load(info + Q_ROW_LAST)
    tma_row0 = gl.load(info + K_ROW0)
    kv_len = gl.load(info + KV_LEN)
    kv_start = gl.load(info + KV_START)
    kv_end = gl.load(info + KV_END)
    full_start = gl.load(info + FULL_START)
    full_end = gl.load(info + FULL_END)
    tma_last = kv_len - BLOCK_N
    num_tiles = (kv_end - kv_start + BLOCK_N - 1) // BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)

    producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
                v_empty, q_row0, head, num_tiles, kv_start, tma_row0, tma_last,
                (head // GROUP) * HEAD_DIM, HEAD_DIM, BLOCK_N, STAGES)  # fmt: skip
    # The consumers' arguments are written out for each: in Gluon's frontend (triton 3.6) a tuple
    # built by concatenation loses its constexprs, and ``*`` unpacking is not supported.
    # fmt: off
    gl.warp_specialize(
        [(_consume, (0, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, OUT, LSE,
                     LO, HI, q_row0, q_row_last, head, num_tiles, kv_start, full_start, full_end,
                     tma_last, qk_scale, softcap_log2, stride_ot, stride_oh, HQ, HEAD_DIM, BLOCK_N,
                     STAGES, SOFTCAP, RETURN_LSE)),
         (_consume, (1, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, OUT, LSE,
                     LO, HI, q_row0, q_row_last, head, num_tiles, kv_start, full_start, full_end,
                     tma_last, qk_scale, softcap_log2, stride_ot, stride_oh, HQ, HEAD_DIM, BLOCK_N,
                     STAGES, SOFTCAP, RETURN_LSE)),
         (_produce, producer)],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
    # fmt: on


def forward_gluon(q, k, v, plan, sched, out, lse, qk_scale: float, softcap_log2: float,
                  softcap: bool, stages: int) -> None:  # fmt: skip
    """Launch over packed ``q [total_q, Hq, D]``, ``k, v [total_k, Hkv, D]`` (see ``uses_gluon``)
    with the step's tile schedule of ``2 * ROWS``-query tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .schedule import INFO

    assert sched.block_m == 2 * ROWS.value
    hq, d = q.shape[1], q.shape[2]
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]

    def desc(t, rows):
        flat = t.view(t.shape[0], t.shape[1] * d)
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], el)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, d], layout)

    grid = (sched.num_tiles * hq,)
    attn_fwd_gluon[grid](
        desc(q, ROWS.value), desc(k, sched.block_n), desc(v, sched.block_n), out,
        lse if lse is not None else out, plan.lo, plan.hi, sched.info, out.stride(0), out.stride(1),
        qk_scale, softcap_log2, HQ=hq, GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_N=sched.block_n,
        STAGES=stages, SOFTCAP=softcap, RETURN_LSE=lse is not None, N_INFO=len(INFO),
        CONSUMER_REGS=240, PRODUCER_REGS=24, num_warps=4,
    )  # fmt: skip
