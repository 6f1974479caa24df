"""The dQ kernel of the backward pass: one program = one query tile (``BLOCK_M`` queries of one
sequence, from the forward's ``tile_schedule``) x one query head, walking the key tiles the
forward walks: ``[kv_start, kv_end)`` with the FULL tiles ``[full_start, full_end)`` unmasked,
then with span groups each group's key-tile runs outside that range (``group_args``), masked
to the group so that no pair counts twice. Per key tile it recomputes ``p`` from the saved LSE
and accumulates ``dq += ds @ K`` in fp32 (bwd_scores.py has the math). ``SPLIT`` programs share a
tile, each owning ``HEAD_DIM // SPLIT`` columns of dq (d512: the accumulator and Q, dO of a row
block at full width do not fit the registers together).

No key is read outside the tile's own sequence (addresses clamped as the forward's, through
``rows.kv_rows``), queries past the sequence's end load as zeros and are never stored; no
atomics: each dq element is written by one program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bwd_scores import score_grads
from .columns import FULL_END, FULL_START, K_ROW0, KV_END, KV_LEN, KV_START, Q_ROW0, Q_ROW_LAST
from .mask import tile_mask
from .rows import kv_rows


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, K, V, n, key_end, k_row0, lo, hi, gsel, KG, stride_kt, stride_vt, offs_n,
    offs_d, offs_dp, qk_scale, softcap_log2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """The key tile at ``n``: no key at or past ``key_end`` is read (masked tiles clamp their
    addresses below it, as the forward's)."""
    rows = kv_rows(0, n, key_end, k_row0, offs_n, MASKED, False, 1, BLOCK_N)
    if HEAD_DIM != D:  # head_dim padded up to a power of two: the pad columns read as zero
        k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
        v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    else:
        k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :])
        v = tl.load(V + rows[:, None] * stride_vt + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    _, ds = score_grads(s, dp, lse2[:, None], delta[:, None], qk_scale, softcap_log2, SOFTCAP)
    if MASKED:
        ds = tl.where(tile_mask(n + offs_n, lo, hi, gsel, KG, 0, key_end, GROUPS, CLAMP), ds, 0.0)
    if SPLIT == 1:
        k_part = k
    else:
        k_part = tl.load(
            K + rows[:, None] * stride_kt + offs_dp[None, :], mask=offs_dp[None, :] < D, other=0.0
        )
    return tl.dot(ds.to(k.dtype), k_part, dq, input_precision=DOT_PRECISION)


@triton.jit
def _dq_walk(
    dq, q, do, lse2, delta, K, V, start, end, key_end, k_row0, lo, hi, gsel, KG, stride_kt, stride_vt,
    offs_n, offs_d, offs_dp, qk_scale, softcap_log2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOPS: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """Key tiles ``[start, end)`` in steps of BLOCK_N (``while`` under the interpreter, which
    cannot take loaded scalars as ``range`` bounds: kernel._walk)."""
    if WHILE_LOOPS:
        n = start
        while n < end:
            dq = _dq_tile(
                dq, q, do, lse2, delta, K, V, n, key_end, k_row0, lo, hi, gsel, KG, stride_kt, stride_vt,
                offs_n, offs_d, offs_dp, qk_scale, softcap_log2, MASKED, SOFTCAP, HEAD_DIM, D, BLOCK_N,
                SPLIT, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
            n += BLOCK_N
    else:
        for n in range(start, end, BLOCK_N):
            dq = _dq_tile(
                dq, q, do, lse2, delta, K, V, n, key_end, k_row0, lo, hi, gsel, KG, stride_kt, stride_vt,
                offs_n, offs_d, offs_dp, qk_scale, softcap_log2, MASKED, SOFTCAP, HEAD_DIM, D, BLOCK_N,
                SPLIT, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE2, DELTA, DQ, LO, HI, TILE_INFO, Q_GROUP, K_GROUP, GROUP_RUNS, RUNS, stride_qt,
    stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    qk_scale, softcap_log2, scale, HQ: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOPS: tl.constexpr, N_INFO: tl.constexpr,
    GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    # heads fastest, as the forward: the heads of one tile share its K/V tiles through L2
    pid = tl.program_id(0)
    part = pid % SPLIT
    pid = pid // SPLIT
    tile = pid // HQ
    head = pid % HQ
    kv_head = head // GROUP

    info = TILE_INFO + tile * N_INFO
    q_row0 = tl.load(info + Q_ROW0)
    q_row_last = tl.load(info + Q_ROW_LAST)
    k_row0 = tl.load(info + K_ROW0).to(tl.int64)
    kv_len = tl.load(info + KV_LEN)
    kv_start = tl.load(info + KV_START)
    kv_end = tl.load(info + KV_END)
    full_start = tl.load(info + FULL_START)
    full_end = tl.load(info + FULL_END)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dp = part * (HEAD_DIM // SPLIT) + tl.arange(0, HEAD_DIM // SPLIT)
    row_ok = q_row0 + offs_m <= q_row_last
    # Rows past the sequence's end copy its last row's interval (as the forward's): a harmless
    # duplicate on zero inputs, never stored.
    q_idx = tl.minimum(q_row0 + offs_m, q_row_last)
    lo = tl.load(LO + q_idx)
    hi = tl.load(HI + q_idx)
    if GROUPS:  # the interval walk masks with the rows' groups too, reading keys to the end
        gq = tl.load(Q_GROUP + q_idx)
        gsel = tl.where(gq >= 0, gq, -2)
        KG = K_GROUP + k_row0
        key_end = kv_len
    else:
        gsel = lo
        KG = K_GROUP
        key_end = kv_end

    q_rows = q_row0.to(tl.int64) + offs_m
    cell = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=cell, other=0.0)
    do = tl.load(
        DO + q_rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=cell, other=0.0
    )
    lse2 = tl.load(LSE2 + q_rows * HQ + head, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + q_rows * HQ + head, mask=row_ok, other=0.0)
    K += kv_head * stride_kh
    V += kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM // SPLIT], dtype=tl.float32)

    # PARTIAL key tiles before the FULL range, the FULL tiles, PARTIAL tiles after it
    dq = _dq_walk(
        dq, q, do, lse2, delta, K, V, kv_start, full_start, key_end, k_row0, lo, hi, gsel, KG, stride_kt,
        stride_vt, offs_n, offs_d, offs_dp, qk_scale, softcap_log2, 1, SOFTCAP, HEAD_DIM, D, BLOCK_N, SPLIT,
        DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
    )  # fmt: skip
    dq = _dq_walk(
        dq, q, do, lse2, delta, K, V, full_start, full_end, key_end, k_row0, lo, hi, gsel, KG, stride_kt,
        stride_vt, offs_n, offs_d, offs_dp, qk_scale, softcap_log2, 0, SOFTCAP, HEAD_DIM, D, BLOCK_N, SPLIT,
        DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
    )  # fmt: skip
    dq = _dq_walk(
        dq, q, do, lse2, delta, K, V, full_end, kv_end, key_end, k_row0, lo, hi, gsel, KG, stride_kt,
        stride_vt, offs_n, offs_d, offs_dp, qk_scale, softcap_log2, 1, SOFTCAP, HEAD_DIM, D, BLOCK_N, SPLIT,
        DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
    )  # fmt: skip

    if GROUPS:
        # The rows' groups' keys outside [kv_start, kv_end), run by run, each group's walk
        # masked to its own rows and keys (kernel.attn_fwd's group walk, key_end = the run's end).
        main_end = kv_start + tl.cdiv(kv_end - kv_start, BLOCK_N) * BLOCK_N
        g = tl.min(tl.where(gq >= 0, gq, 2147483647))
        g_last = tl.max(gq)
        while g <= g_last:
            if tl.max((gq == g).to(tl.int32)) > 0:
                gsel = tl.where(gq == g, gq, -2)
                r = tl.load(GROUP_RUNS + 2 * g)
                r_end = tl.load(GROUP_RUNS + 2 * g + 1)
                while r < r_end:
                    a = tl.load(RUNS + 2 * r)
                    b = tl.load(RUNS + 2 * r + 1)
                    if not CLAMP:  # group keys before the walk above (clamp: none below lo)
                        dq = _dq_walk(
                            dq, q, do, lse2, delta, K, V, a, tl.minimum(b, kv_start), b, k_row0, lo, hi,
                            gsel, KG, stride_kt, stride_vt, offs_n, offs_d, offs_dp, qk_scale, softcap_log2,
                            1, SOFTCAP, HEAD_DIM, D, BLOCK_N, SPLIT, DOT_PRECISION, WHILE_LOOPS, True, CLAMP,
                        )  # fmt: skip
                    dq = _dq_walk(
                        dq, q, do, lse2, delta, K, V, tl.maximum(a, main_end), b, b, k_row0, lo, hi, gsel, KG,
                        stride_kt, stride_vt, offs_n, offs_d, offs_dp, qk_scale, softcap_log2, 1, SOFTCAP,
                        HEAD_DIM, D, BLOCK_N, SPLIT, DOT_PRECISION, WHILE_LOOPS, True, CLAMP,
                    )  # fmt: skip
                    r += 1
            g += 1

    dq = dq * scale
    dq_ptrs = DQ + q_rows[:, None] * stride_dqt + head * stride_dqh + offs_dp[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_dp[None, :] < D))
