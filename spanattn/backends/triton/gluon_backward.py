"""The Gluon backward kernels' launches (kernel_gluon_dkdv.py, kernel_gluon_dkdv_split.py,
kernel_gluon_dq.py): host TMA descriptors of q, dO, K and V, and each kernel's grid and
constants, called by gradients.backward."""

from __future__ import annotations

import torch

from . import kernel_gluon_dkdv, kernel_gluon_dkdv_split, kernel_gluon_dq, kernel_gluon_dq_split
from .columns import INFO, KEY_INFO
from .gluon_parts import CONSUMER_REGS, PRODUCER_REGS, smem_layout
from .key_schedule import key_schedule
from .schedule_triton import tile_schedule
from .tma_layout import tma_matrix


def key_tiles(d: int) -> tuple[int, int]:
    """The dK/dV kernels' (queries per step, keys per program) at head_dim ``d``."""
    return kernel_gluon_dkdv.TILES[d][:2]


def query_tiles(d: int) -> tuple[int, int]:
    """The dQ kernels' (queries per program, keys per step) at head_dim ``d``."""
    return kernel_gluon_dq.TILES[d][:2]


def descriptor(t: torch.Tensor, rows: int, cols: int):
    """A host TMA descriptor of ``t [tokens, heads, D]`` read in ``rows x cols`` boxes, and the
    (rows, columns) a head moves in its matrix (tma_layout)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m = tma_matrix(t)
    desc = TensorDescriptor(m.matrix, list(m.matrix.shape), list(m.matrix.stride()), [rows, cols],
                            smem_layout(rows, cols, t.dtype))  # fmt: skip
    return desc, m.head_rows, m.head_cols


def dkdv(q, k, v, dout, lse2, delta, dk, dv, plan, *, qk_scale, softcap_log2, scale, softcap) -> None:
    """dK, dV into ``dk``, ``dv`` over the plan's key schedule for kernel_gluon_dkdv.TILES's
    tiles of the head_dim; every tensor as gradients.backward has it, TMA-readable
    (gradients._gluon_reads). d256 and d512 run kernel_gluon_dkdv_split."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    block_m, block_n, stages = kernel_gluon_dkdv.TILES[d]
    keys = key_schedule(plan, *key_tiles(d))
    if d == 128:
        kernel, cols, programs = kernel_gluon_dkdv.attn_bwd_dkdv_gluon, d, 1
    else:  # 128-column pieces; at d512 two programs a key tile (kernel_gluon_dkdv_split)
        kernel, cols, programs = kernel_gluon_dkdv_split.attn_bwd_dkdv_gluon_split, 128, d // 256
    qd, q_hr, q_hc = descriptor(q, block_m, cols)
    dod, do_hr, do_hc = descriptor(dout, block_m, cols)
    kd, k_hr, k_hc = descriptor(k, block_n, cols)
    vd, _, _ = descriptor(v, block_n, cols)
    kernel[(keys.num_tiles * hkv * programs,)](
        qd, dod, kd, vd, lse2, delta, plan.lo, plan.hi, keys.info, dk, dv, dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), qk_scale, softcap_log2, scale, q_hr, q_hc, do_hr, do_hc, k_hr, k_hc,
        HQ=hq, GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, STAGES=stages, SOFTCAP=softcap,
        N_INFO=len(KEY_INFO), CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
    )  # fmt: skip


def dq_fits(plan, d: int) -> bool:
    """Is every sequence of the plan at least a dQ key tile long (kernel_gluon_dq reads the last
    tile shifted back)? Host plans only: a device plan's lengths live on the device."""
    return plan.capacity is None and plan.min_seqlen_k >= kernel_gluon_dq.TILES[d][1]


def dq(q, k, v, dout, lse2, delta, dq_out, plan, *, qk_scale, softcap_log2, scale, softcap) -> None:
    """dQ into ``dq_out`` over the forward's schedule for kernel_gluon_dq's tiles of the
    head_dim; every tensor as gradients.backward has it, TMA-readable, every sequence at least a
    key tile long (``dq_fits``)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    _, block_n, stages = kernel_gluon_dq.TILES[d]
    tiles = tile_schedule(plan, *query_tiles(d))
    rows = kernel_gluon_dq.ROWS.value
    if d == 512:  # 128-column pieces, both consumers on one 64-query tile
        kernel, cols = kernel_gluon_dq_split.attn_bwd_dq_gluon_split, 128
    else:
        kernel, cols = kernel_gluon_dq.attn_bwd_dq_gluon, d
    qd, q_hr, q_hc = descriptor(q, rows, cols)
    dod, do_hr, do_hc = descriptor(dout, rows, cols)
    kd, k_hr, k_hc = descriptor(k, block_n, cols)
    vd, _, _ = descriptor(v, block_n, cols)
    kernel[(tiles.num_tiles * hq,)](
        qd, dod, kd, vd, lse2, delta, plan.lo, plan.hi, tiles.info, dq_out, dq_out.stride(0),
        dq_out.stride(1), qk_scale, softcap_log2, scale, q_hr, q_hc, do_hr, do_hc, k_hr, k_hc, HQ=hq,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, SOFTCAP=softcap, N_INFO=len(INFO),
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
    )  # fmt: skip
