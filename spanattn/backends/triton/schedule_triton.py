"""The tile schedule of schedule.py in one Triton launch (plus the LPT sort), and the plan's
cached schedule that the backend asks for (``tile_schedule``: this launch on CUDA, the torch
definition elsewhere). The torch definition is ~30 small kernels, whose int64 scatter-min/max
over 32k tokens alone took 0.4 ms of GPU time and the whole build 4-6 ms of wall time per step
on an H200 (results/2026-11-29-triton-h200-s4.json, ``schedule_ms``); tests hold the two equal."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .columns import (
    FULL_END,
    FULL_START,
    INFO,
    K_ROW0,
    KV_END,
    KV_LEN,
    KV_START,
    N_WALK,
    POST_START,
    POST_TILES,
    PRE_START,
    PRE_TILES,
    Q_ROW0,
    Q_ROW_LAST,
    SEQ,
    WALK,
)
from .schedule import TileSchedule, build_device_schedule, build_schedule, ordered, tile_starts


@triton.jit(do_not_specialize=["num_tiles"])  # changes every step: never a reason to recompile
def _tile_info_kernel(
    starts_ptr, num_tiles, lo_ptr, hi_ptr, cu_q_ptr, cu_k_ptr, info_ptr, cost_ptr, q_group_ptr,
    extent_ptr, walk_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_INFO: tl.constexpr,
    GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    seq = tl.load(starts_ptr + t)
    q_row0 = tl.load(cu_q_ptr + seq) + tl.load(starts_ptr + num_tiles + t)
    q_row_last = tl.minimum(q_row0 + BLOCK_M, tl.load(cu_q_ptr + seq + 1)) - 1
    k_row0 = tl.load(cu_k_ptr + seq)
    rows = q_row0 + tl.arange(0, BLOCK_M)
    valid = rows <= q_row_last
    lo = tl.load(lo_ptr + rows, mask=valid, other=0)
    hi = tl.load(hi_ptr + rows, mask=valid, other=0)
    lo_min = tl.min(tl.where(valid, lo, 2147483647))
    lo_max = tl.max(tl.where(valid, lo, -1))
    hi_min = tl.min(tl.where(valid, hi, 2147483647))
    hi_max = tl.max(tl.where(valid, hi, -1))
    kv_start = lo_min // BLOCK_N * BLOCK_N
    kv_end = hi_max + 1
    full_start = tl.minimum((lo_max + BLOCK_N - 1) // BLOCK_N * BLOCK_N, kv_end)
    out = info_ptr + t * N_INFO
    tl.store(out + Q_ROW0, q_row0)
    tl.store(out + Q_ROW_LAST, q_row_last)
    tl.store(out + K_ROW0, k_row0)
    tl.store(out + KV_LEN, tl.load(cu_k_ptr + seq + 1) - k_row0)
    tl.store(out + SEQ, seq)
    tl.store(out + KV_START, kv_start)
    tl.store(out + KV_END, kv_end)
    tl.store(out + FULL_START, full_start)
    tl.store(out + FULL_END, tl.maximum((hi_min + 1) // BLOCK_N * BLOCK_N, full_start))
    if GROUPS:  # the cost spans the rows' groups' keys as well; the walk (group_walk.py) too
        gq = tl.load(q_group_ptr + rows, mask=valid, other=-1)
        grouped = gq >= 0
        last = tl.max(tl.load(extent_ptr + 2 * gq + 1, mask=grouped, other=-1) - tl.where(grouped, k_row0, 0))
        hi_max = tl.maximum(hi_max, last)
        post_start = kv_start + (kv_end - kv_start + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        walk = walk_ptr + t * N_WALK
        tl.store(walk + POST_START, post_start)
        # truncating division: a negative quotient differs from torch's floor but clamps to 0 alike
        tl.store(walk + POST_TILES, tl.maximum((last + 1 - post_start + BLOCK_N - 1) // BLOCK_N, 0))
        if CLAMP:  # group keys below a row's lo are not allowed, and lo >= kv_start: no pre walk
            tl.store(walk + PRE_START, 0)
            tl.store(walk + PRE_TILES, 0)
        else:
            first = tl.load(extent_ptr + 2 * gq, mask=grouped, other=2147483647)
            first = tl.min(tl.where(grouped, first - k_row0, 2147483647))
            has = first < kv_start
            pre_start = tl.where(has, first // BLOCK_N * BLOCK_N, 0)
            tl.store(walk + PRE_START, pre_start)
            tl.store(walk + PRE_TILES, tl.where(has, (kv_start - pre_start) // BLOCK_N, 0))
            lo_min = tl.minimum(lo_min, first)
    tl.store(cost_ptr + t, hi_max - lo_min + 1)


def build_schedule_triton(plan, block_m: int, block_n: int, lpt: bool = True) -> TileSchedule:
    """schedule.build_schedule, one launch for the table (and the span groups' walk)."""
    tile_seq, tile_qstart = tile_starts([s.q_len for s in plan.batch.seqs], block_m)
    total = tile_seq.shape[0]
    starts = torch.stack([tile_seq, tile_qstart]).to(torch.int32).to(plan.device)
    info = torch.empty(total, len(INFO), dtype=torch.int32, device=plan.device)
    cost = torch.empty(total, dtype=torch.int32, device=plan.device)
    g = plan.groups
    # without groups the kernel compiled with GROUPS=False never reads or writes the last three
    walk = None if g is None else torch.empty(total, len(WALK), dtype=torch.int32, device=plan.device)
    _tile_info_kernel[(total,)](
        starts, total, plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k, info, cost,
        *((plan.lo,) * 3 if g is None else (g.q_group, g.extents, walk)),
        BLOCK_M=block_m, BLOCK_N=block_n, N_INFO=len(INFO), GROUPS=g is not None,
        CLAMP=g is not None and g.clamp,
    )  # fmt: skip
    return ordered(block_m, block_n, info, cost, lpt, walk)


def tile_schedule(plan, block_m: int, block_n: int, lpt: bool = True) -> TileSchedule:
    """The plan's cached schedule for ``block_m x block_n`` tiles (built on the first layer of
    a step, reused by the others)."""

    def build():
        if plan.capacity is not None:  # a device plan: capacity-sized, nothing read on the host
            return build_device_schedule(plan, block_m, block_n, lpt)
        if plan.device.type == "cuda":
            return build_schedule_triton(plan, block_m, block_n, lpt)
        return build_schedule(plan, block_m, block_n, lpt)

    return plan.cached(("triton.tiles", block_m, block_n, lpt), build)
