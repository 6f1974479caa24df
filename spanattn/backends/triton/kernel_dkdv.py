"""The dK/dV kernel of the backward pass: one program = one key tile (``BLOCK_N`` keys of one
sequence, from key_schedule.py) x one KV head, its K and V tiles held while it walks the query
tiles that see its keys, for each query head of the KV head's GQA group in turn: dK and dV are
summed over the group inside the program, in a fixed order (no atomics: same bits every call).

The walk is the forward's transposed: the column hull ``[q_start, q_end)`` of the tile's keys,
the FULL query tiles ``[full_start, full_end)`` (inside every key's column) unmasked, the rest
masked by ``mask.tile_mask`` on the query rows' ``lo``/``hi`` (the forward's predicate, used
transposed). With span groups the hull walk masks with the rows' groups too, and each group of
the tile's keys then walks its query-tile runs (``groups.query_tile_runs``) outside the hull,
masked to that group's rows and keys, so that no pair counts twice. Tiles are computed
transposed (``s^T = K Q^T``, ``[BLOCK_N, BLOCK_M]``), so that ``dV += p^T dO`` and ``dK += ds^T
Q`` take their register operand as it is. ``SPLIT`` programs share a key tile, each owning
``HEAD_DIM // SPLIT`` columns of dK and dV (d512).

Isolation: keys past the sequence's end read its last key (finite whatever the neighbours
hold) and are never stored; query rows past the chunk's end load as zeros and are masked out
of every tile that may hold them (a FULL tile lies inside the chunk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bwd_scores import score_grads
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
from .mask import tile_mask


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, m, kv_idx, kv_len, Q, DO, LSE2, DELTA, LO, HI, Q_GROUP, KG, q_row0, q_len, g_lo, g_hi,
    stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale, softcap_log2, HQ: tl.constexpr,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """The query tile at ``m`` (query index in the chunk) of one head (``Q``, ``DO``, ``LSE2``,
    ``DELTA`` point at its column). Masked: a row's interval, or its group's keys where its
    group lies in ``[g_lo, g_hi]``."""
    q_local = m + offs_m
    row_ok = q_local < q_len
    rows = q_row0.to(tl.int64) + q_local
    cell = row_ok[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + rows[:, None] * stride_qt + offs_d[None, :], mask=cell, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + offs_d[None, :], mask=cell, other=0.0)
    lse2 = tl.load(LSE2 + rows * HQ, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows * HQ, mask=row_ok, other=0.0)
    s = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    p, ds = score_grads(s, dp, lse2[None, :], delta[None, :], qk_scale, softcap_log2, SOFTCAP)
    if MASKED:
        q_idx = q_row0 + tl.minimum(q_local, q_len - 1)
        hi = tl.where(row_ok, tl.load(HI + q_idx), -1)  # rows past the chunk see nothing
        lo = tl.load(LO + q_idx)
        if GROUPS:
            gq = tl.load(Q_GROUP + q_idx)
            gsel = tl.where(row_ok & (gq >= g_lo) & (gq <= g_hi), gq, -2)
        else:
            gsel = lo
        allowed = tl.trans(tile_mask(kv_idx, lo, hi, gsel, KG, 0, kv_len, GROUPS, CLAMP))
        p = tl.where(allowed, p, 0.0)
        ds = tl.where(allowed, ds, 0.0)
    if SPLIT == 1:
        q_part = q
        do_part = do
    else:
        part = row_ok[:, None] & (offs_dp[None, :] < D)
        q_part = tl.load(Q + rows[:, None] * stride_qt + offs_dp[None, :], mask=part, other=0.0)
        do_part = tl.load(DO + rows[:, None] * stride_dot + offs_dp[None, :], mask=part, other=0.0)
    dv = tl.dot(p.to(do.dtype), do_part, dv, input_precision=DOT_PRECISION)
    dk = tl.dot(ds.to(q.dtype), q_part, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_walk(
    dk, dv, k, v, start, end, kv_idx, kv_len, Q, DO, LSE2, DELTA, LO, HI, Q_GROUP, KG, q_row0, q_len,
    g_lo, g_hi, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale, softcap_log2, HQ: tl.constexpr,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOPS: tl.constexpr, GROUPS: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """Query tiles ``[start, end)`` in steps of BLOCK_M (``while`` under the interpreter, as
    kernel._walk)."""
    if WHILE_LOOPS:
        m = start
        while m < end:
            dk, dv = _dkdv_tile(
                dk, dv, k, v, m, kv_idx, kv_len, Q, DO, LSE2, DELTA, LO, HI, Q_GROUP, KG, q_row0, q_len, g_lo,
                g_hi, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale, softcap_log2, HQ, MASKED,
                SOFTCAP, D, SPLIT, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
            m += BLOCK_M
    else:
        for m in range(start, end, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, m, kv_idx, kv_len, Q, DO, LSE2, DELTA, LO, HI, Q_GROUP, KG, q_row0, q_len, g_lo,
                g_hi, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale, softcap_log2, HQ, MASKED,
                SOFTCAP, D, SPLIT, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, LO, HI, KEY_TILE_INFO, Q_GROUP, K_GROUP, Q_RUN_INDEX, Q_RUNS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dkt,
    stride_dkh, stride_dvt, stride_dvh, qk_scale, softcap_log2, scale, HQ: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, N_INFO: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    part = pid % SPLIT
    pid = pid // SPLIT
    tile = pid // (HQ // GROUP)
    kv_head = pid % (HQ // GROUP)

    info = KEY_TILE_INFO + tile * N_INFO
    k_row0 = tl.load(info + KEY_K_ROW0).to(tl.int64)
    kv_len = tl.load(info + KEY_KV_LEN)
    n_start = tl.load(info + KEY_N_START)
    q_row0 = tl.load(info + KEY_Q_ROW0)
    q_len = tl.load(info + KEY_Q_LEN)
    q_start = tl.load(info + KEY_Q_START)
    q_end = tl.load(info + KEY_Q_END)
    full_start = tl.load(info + KEY_FULL_START)
    full_end = tl.load(info + KEY_FULL_END)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dp = part * (HEAD_DIM // SPLIT) + tl.arange(0, HEAD_DIM // SPLIT)
    kv_idx = n_start + offs_n
    key_ok = kv_idx < kv_len
    # keys past the sequence's end read its last key: finite whatever the next sequence holds
    k_rows = k_row0 + tl.minimum(kv_idx, kv_len - 1).to(tl.int64)
    dmask = offs_d[None, :] < D
    k = tl.load(
        K + k_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=dmask, other=0.0
    )
    v = tl.load(
        V + k_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=dmask, other=0.0
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM // SPLIT], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM // SPLIT], dtype=tl.float32)
    if GROUPS:  # the keys' groups, read again by tile_mask at every masked tile
        KG = K_GROUP + k_row0
        gk = tl.load(KG + kv_idx, mask=key_ok, other=-1)
    else:
        KG = K_GROUP
    main_end = q_start + tl.cdiv(q_end - q_start, BLOCK_M) * BLOCK_M

    for h in range(GROUP):
        head = kv_head * GROUP + h
        Qh, DOh, LSE2h, DELTAh = Q + head * stride_qh, DO + head * stride_doh, LSE2 + head, DELTA + head
        # PARTIAL query tiles before the FULL range, the FULL tiles, PARTIAL tiles after it;
        # masked, every row counts its own group's keys (groups 0 .. 2^31 - 1)
        dk, dv = _dkdv_walk(
            dk, dv, k, v, q_start, full_start, kv_idx, kv_len, Qh, DOh, LSE2h, DELTAh, LO, HI, Q_GROUP, KG,
            q_row0, q_len, 0, 2147483647, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale,
            softcap_log2, HQ, 1, SOFTCAP, D, BLOCK_M, SPLIT, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
        )  # fmt: skip
        dk, dv = _dkdv_walk(
            dk, dv, k, v, full_start, full_end, kv_idx, kv_len, Qh, DOh, LSE2h, DELTAh, LO, HI, Q_GROUP, KG,
            q_row0, q_len, 0, 2147483647, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale,
            softcap_log2, HQ, 0, SOFTCAP, D, BLOCK_M, SPLIT, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
        )  # fmt: skip
        dk, dv = _dkdv_walk(
            dk, dv, k, v, full_end, q_end, kv_idx, kv_len, Qh, DOh, LSE2h, DELTAh, LO, HI, Q_GROUP, KG,
            q_row0, q_len, 0, 2147483647, stride_qt, stride_dot, offs_m, offs_d, offs_dp, qk_scale,
            softcap_log2, HQ, 1, SOFTCAP, D, BLOCK_M, SPLIT, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
        )  # fmt: skip
        if GROUPS:
            # The queries of the keys' groups outside the hull, group by group and run by run,
            # each walk masked to one group's rows and keys. In clamp mode no query after the
            # hull sees a key of the tile through its group: it would need k >= lo[q] and, being
            # outside q's interval, k > hi[q] >= q's position, which puts k in the chunk, where
            # the query at k's position (later than q) sees k: the hull would reach past q.
            g = tl.min(tl.where(gk >= 0, gk, 2147483647))
            g_last = tl.max(gk)
            while g <= g_last:
                if tl.max((gk == g).to(tl.int32)) > 0:
                    r = tl.load(Q_RUN_INDEX + 2 * g)
                    r_end = tl.load(Q_RUN_INDEX + 2 * g + 1)
                    while r < r_end:
                        a = tl.load(Q_RUNS + 2 * r)
                        b = tl.load(Q_RUNS + 2 * r + 1)
                        dk, dv = _dkdv_walk(
                            dk, dv, k, v, a, tl.minimum(b, q_start), kv_idx, kv_len, Qh, DOh, LSE2h, DELTAh,
                            LO, HI, Q_GROUP, KG, q_row0, q_len, g, g, stride_qt, stride_dot, offs_m, offs_d,
                            offs_dp, qk_scale, softcap_log2, HQ, 1, SOFTCAP, D, BLOCK_M, SPLIT, DOT_PRECISION,
                            WHILE_LOOPS, True, CLAMP,
                        )  # fmt: skip
                        if not CLAMP:
                            dk, dv = _dkdv_walk(
                                dk, dv, k, v, tl.maximum(a, main_end), b, kv_idx, kv_len, Qh, DOh, LSE2h,
                                DELTAh, LO, HI, Q_GROUP, KG, q_row0, q_len, g, g, stride_qt, stride_dot,
                                offs_m, offs_d, offs_dp, qk_scale, softcap_log2, HQ, 1, SOFTCAP, D, BLOCK_M,
                                SPLIT, DOT_PRECISION, WHILE_LOOPS, True, CLAMP,
                            )  # fmt: skip
                        r += 1
                g += 1

    out = key_ok[:, None] & (offs_dp[None, :] < D)
    k_rows = k_row0 + kv_idx.to(tl.int64)
    dk_ptrs = DK + k_rows[:, None] * stride_dkt + kv_head * stride_dkh + offs_dp[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=out)
    dv_ptrs = DV + k_rows[:, None] * stride_dvt + kv_head * stride_dvh + offs_dp[None, :]
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=out)
