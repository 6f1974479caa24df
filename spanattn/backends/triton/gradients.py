"""The triton backend's backward pass: dq, dk, dv of spanattn's attention from the forward's
output and LSE, in three launches: the rows' ``delta`` and LSE in log2 units
(bwd_scores.bwd_preprocess), dK/dV by key tiles walking the queries that see them
(kernel_dkdv.py over key_schedule.py's table) and dQ by query tiles walking the keys they see
(kernel_dq.py over the forward's ``tile_schedule``). Deterministic (no atomics: every output
element is written by one program, the GQA group's heads summed inside it) and isolated (no
program reads another sequence's rows). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from . import bwd_scores, kernel_dkdv, kernel_dq
from .columns import INFO, KEY_INFO
from .configs import Config, padded_head_dim, pick_backward
from .group_tensors import group_args
from .kernel import INTERPRETED
from .key_schedule import key_schedule, query_group_args
from .scales import kernel_scales
from .schedule_triton import tile_schedule

# elements of O and dO a preprocess program reads per head: its rows are this over head_dim
PREPROCESS_ELEMENTS = 4096


def backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    plan,
    *,
    scale,
    softcap=None,
    dlse=None,
    config: tuple[Config, Config] | None = None,
    gluon: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of spanattn's attention over packed varlen ``q [total_q, Hq, D]``, ``k/v
    [total_k, Hkv, D]``.

    out: the forward's output; lse: its ``[total_q, Hq]`` fp32 LSE (natural log, scale
        applied: ``forward(..., return_lse=True)``); dout: the gradient of ``out``; dlse: the
        gradient of the LSE output, or None. Any strides with a unit last one (others are
        copied once, and so are tensors with a zero stride, such as a gradient expanded from a
        sum).
    config: ``(dK/dV, dQ)`` tiles instead of ``configs.pick_backward``'s (tests).
    gluon: run dK/dV on kernel_gluon_dkdv and dQ on kernel_gluon_dq (Hopper;
        ``gluon_backward_runs`` said so) where TMA can read q, k, v and dout (and for dQ, every
        sequence is a key tile long); kernel_dkdv.py and kernel_dq.py otherwise.
    Returns dq like q, dk like k, dv like v (dtype and shape; contiguous), accumulated in fp32.
    """
    q, k, v, out, dout = (_readable(t) for t in (q, k, v, out, dout))
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    head_dim = padded_head_dim(d)
    dkdv_cfg, dq_cfg = config or pick_backward(d, q.dtype, INTERPRETED)
    qk_scale, softcap_log2 = kernel_scales(scale, softcap)
    delta, lse2 = _preprocess(out, dout, lse, dlse, head_dim)
    groups = plan.groups
    shared = dict(
        HQ=hq, GROUP=hq // hkv, HEAD_DIM=head_dim, D=d, SOFTCAP=bool(softcap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOPS=INTERPRETED,
        GROUPS=groups is not None, CLAMP=groups is not None and groups.clamp,
    )  # fmt: skip
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1))

    # a device plan's rows and keys past the step's belong to no tile: their gradients are zero
    alloc = torch.empty if plan.capacity is None else torch.zeros
    like = lambda t: alloc(t.shape, dtype=t.dtype, device=t.device)
    dk, dv = like(k), like(v)
    gluon = gluon and config is None and plan.groups is None and _gluon_reads(q, k, v, dout)
    scales = dict(qk_scale=qk_scale, softcap_log2=softcap_log2, scale=scale, softcap=bool(softcap))
    if gluon:  # imported on first use, as the forward's Gluon kernels
        from . import gluon_backward

        gluon_backward.dkdv(q, k, v, dout, lse2, delta, dk, dv, plan, **scales)
    else:
        keys = key_schedule(plan, dkdv_cfg.block_m, dkdv_cfg.block_n)
        kernel_dkdv.attn_bwd_dkdv[(keys.num_tiles * hkv * dkdv_cfg.dv_split,)](
            q, k, v, dout, lse2, delta, dk, dv, plan.lo, plan.hi, keys.info,
            *query_group_args(plan, dkdv_cfg.block_m), *strides, dout.stride(0), dout.stride(1),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), qk_scale, softcap_log2, scale,
            BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n, SPLIT=dkdv_cfg.dv_split,
            N_INFO=len(KEY_INFO), num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages, **shared,
        )  # fmt: skip

    dq = like(q)
    if gluon and gluon_backward.dq_fits(plan, d):
        gluon_backward.dq(q, k, v, dout, lse2, delta, dq, plan, **scales)
    else:
        tiles = tile_schedule(plan, dq_cfg.block_m, dq_cfg.block_n)
        kernel_dq.attn_bwd_dq[(tiles.num_tiles * hq * dq_cfg.dv_split,)](
            q, k, v, dout, lse2, delta, dq, plan.lo, plan.hi, tiles.info, *group_args(plan, dq_cfg.block_n),
            *strides, dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), qk_scale, softcap_log2,
            scale, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, SPLIT=dq_cfg.dv_split, N_INFO=len(INFO),
            num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages, **shared,
        )  # fmt: skip
    return dq, dk, dv


def _preprocess(out, dout, lse, dlse, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta = rowsum(dO * O) - dlse`` and ``lse * log2(e)``, fp32 ``[total_q, Hq]`` each."""
    total_q, hq, d = out.shape
    delta = torch.empty(total_q, hq, dtype=torch.float32, device=out.device)
    lse2 = torch.empty_like(delta)
    block = min(128, PREPROCESS_ELEMENTS // head_dim)
    dl = lse if dlse is None else dlse.float()  # without dlse the kernel never reads it
    bwd_scores.bwd_preprocess[(-(-total_q // block), hq)](
        out, dout, lse, dl, delta, lse2, total_q, out.stride(0), out.stride(1), dout.stride(0),
        dout.stride(1), lse.stride(0), lse.stride(1), dl.stride(0), dl.stride(1), HQ=hq, HEAD_DIM=head_dim,
        D=d, BLOCK=block, HAS_DLSE=dlse is not None,
    )  # fmt: skip
    return delta, lse2


def _gluon_reads(q, k, v, dout) -> bool:
    """Can TMA read the four (kernel_gluon_dkdv: K and V alike, both packed or both head-major)?"""
    from .tma_layout import tma_form

    forms = [tma_form(t) for t in (q, k, v, dout)]
    return None not in forms and forms[1][3:] == forms[2][3:]


def _readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: any strides with a unit last one, else a contiguous copy;
    so is a tensor with any zero stride (a gradient expanded from a sum has one in every
    dimension, its last included), the rare case not worth a strided variant's checks."""
    return t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous()
