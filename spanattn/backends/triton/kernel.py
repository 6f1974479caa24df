"""The forward kernel: packed varlen attention where query ``i`` sees keys ``[lo[i], hi[i]]``.

One program = one query tile (``BLOCK_M`` consecutive queries of one sequence) x one query head.
The tile's keys form one contiguous range ``[min lo, max hi]`` (docs/design.md section 2), walked in
three loops: PARTIAL tiles before the FULL range, FULL tiles inside ``[max lo, min hi]`` (no mask
math, no bounds checks), PARTIAL tiles after it. For causal rows the first loop is empty and the
last holds the diagonal; for sliding windows the first holds the window's trailing edge.
``ONE_LOOP`` walks the same range in one pipelined loop and decides per tile at run time whether
to mask (faster where the three loops' separate pipeline fills cost more: d256, d512, windows,
d128 on 4 warps).
``DV_SPLIT`` lets several programs share a tile, each computing a slice of the output columns
(d512: the fp32 accumulator of a whole row block does not fit the registers).

Everything that changes from step to step (lengths, spans, batch composition, tile order) is a
tensor argument; constexprs depend only on the model (heads, head_dim, dtype) and the config, so
a serving loop compiles each layer kind once.

A paged KV cache is the ``PAGED`` constexpr: keys are addressed by in-sequence position and
``rows.kv_rows`` turns positions into physical rows, through ``block_table`` entries that ``_walk``
loads one tile ahead (one per tile when a tile fits in a page, else one per key row). Packed
K/V on sm_90+ come through TMA instead (``TMA``): host-made descriptors over the whole packed
K/V; the tile across a sequence's end is read shifted back, never into the next sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .columns import FULL_END, FULL_START, K_ROW0, KV_END, KV_LEN, KV_START, Q_ROW0, Q_ROW_LAST, SEQ
from .mask import tile_mask
from .rows import kv_rows, tile_pages

INTERPRETED = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False


@triton.jit
def _softmax(
    s, m_i, l_i, kv_idx, lo, hi, qk_scale, softcap_log2, partial, gsel, KG, key_lo, key_end,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """The online-softmax step of one tile's raw scores ``s``: ``p`` (fp32, unnormalized), the
    factor ``alpha`` that rescales what was accumulated before, the new row max and row sum.
    Scores live in the log2 domain (exp2 is one MUFU op). MASKED: 0 = a FULL tile, 1 = a
    PARTIAL tile, 2 = decided at run time by ``partial``; masked by ``mask.tile_mask``."""
    if SOFTCAP:
        # c * tanh(x) with x = score * scale / c; tanh(x) = 1 - 2 / (exp(2x) + 1), which saturates
        # cleanly to +-1 (tl has no portable tanh across triton versions). Result in log2 units.
        s = (1.0 - 2.0 / (tl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)) * softcap_log2
        s_scale = 1.0
    else:
        # Raw scores; the scale is folded into exp2's argument below (one FFMA per score).
        s_scale = qk_scale
    if MASKED == 1:
        s = tl.where(tile_mask(kv_idx, lo, hi, gsel, KG, key_lo, key_end, GROUPS, CLAMP), s, float("-inf"))
    elif MASKED == 2:
        if partial:
            s = tl.where(
                tile_mask(kv_idx, lo, hi, gsel, KG, key_lo, key_end, GROUPS, CLAMP), s, float("-inf")
            )
    # m_i is in scaled log2 units; the scale is positive so it commutes with max.
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    if MASKED != 0:
        # A row may have no allowed key in this tile and none seen yet: keep exp2 away from
        # (-inf) - (-inf). Unmasked tiles always hold at least one finite score per row.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s * s_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _attend(
    acc, m_i, l_i, q, K, V, rows, kv_idx, lo, hi, stride_kt, stride_vt, offs_d, offs_dv, qk_scale,
    softcap_log2, partial, gsel, KG, key_end, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr, D: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUPS: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """One KV tile through pointer loads: scores, softmax, P @ V."""
    if HEAD_DIM != D:  # head_dim padded up to a power of two: the pad columns read as zero
        k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    else:
        k = tl.load(K + rows[:, None] * stride_kt + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p, alpha, m_i, l_i = _softmax(
        s, m_i, l_i, kv_idx, lo, hi, qk_scale, softcap_log2, partial, gsel, KG, 0, key_end, MASKED,
        SOFTCAP, GROUPS, CLAMP,
    )  # fmt: skip
    acc = acc * alpha[:, None]
    if HEAD_DIM != D:
        v = tl.load(V + rows[:, None] * stride_vt + offs_dv[None, :], mask=offs_dv[None, :] < D, other=0.0)
    else:
        v = tl.load(V + rows[:, None] * stride_vt + offs_dv[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _tma_tile(
    acc, m_i, l_i, q, n, full_start, full_end, lo, hi, offs_n, qk_scale, softcap_log2, desc_k,
    desc_v, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUPS: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """One KV tile through TMA. The tile across the sequence end is read shifted back to end
    with the sequence (see attn_fwd); its keys below ``n`` were walked by the previous tile."""
    n_load = tl.minimum(n, tma_last)
    k = desc_k.load([tma_row0 + n_load, k_col0])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    partial = (n < full_start) | (n + BLOCK_N > full_end)
    p, alpha, m_i, l_i = _softmax(
        s, m_i, l_i, n_load + offs_n, tl.maximum(lo, n), hi, qk_scale, softcap_log2, partial, gsel, KG,
        n, key_end, MASKED, SOFTCAP, GROUPS, CLAMP,
    )  # fmt: skip
    acc = acc * alpha[:, None]
    v = desc_v.load([tma_row0 + n_load, v_col0])
    acc = tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _walk_tma(
    acc, m_i, l_i, q, start, end, full_start, full_end, lo, hi, offs_n, qk_scale, softcap_log2,
    desc_k, desc_v, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """KV tiles ``[start, end)`` in steps of BLOCK_N through TMA (loops as in ``_walk``)."""
    if WHILE_LOOPS:
        n = start
        while n < end:
            acc, m_i, l_i = _tma_tile(
                acc, m_i, l_i, q, n, full_start, full_end, lo, hi, offs_n, qk_scale, softcap_log2,
                desc_k, desc_v, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, MASKED,
                SOFTCAP, BLOCK_N, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
            n += BLOCK_N
    else:
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i = _tma_tile(
                acc, m_i, l_i, q, n, full_start, full_end, lo, hi, offs_n, qk_scale, softcap_log2,
                desc_k, desc_v, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, MASKED,
                SOFTCAP, BLOCK_N, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _walk(
    acc, m_i, l_i, q, K, V, start, end, kv_end, full_start, full_end, k_row0, BT, last_page, lo,
    hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOPS: tl.constexpr, GROUPS: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """KV tiles ``[start, end)`` in steps of BLOCK_N through pointer loads; no key at or past
    ``kv_end`` is read (masked tiles clamp their addresses below it). A ``for`` loop is what
    triton software-pipelines; the interpreter cannot take loaded scalars as ``range`` bounds under
    numpy >= 2.4 (int() of a 1-element array), so it walks the same tiles with ``while``.

    Paged: each tile's block_table entries are loaded one tile ahead and carried into the next
    iteration. Loaded in the same iteration, they would be a load feeding the K/V loads'
    addresses, which triton's pipeliner counts as a level of indirection: it splits the
    ``num_stages - 1`` tiles of prefetch between that load and K/V (3 stages: K/V one tile ahead
    instead of two) or, at 2 stages, leaves it a synchronous load on every tile's critical path.
    A loaded value carried to the next iteration is neither: the pipeliner issues it beside its
    consumer, one iteration early, and K/V keep the contiguous path's prefetch depth (sm_90
    TTGIR at d128: 3 K/V buffers as packed, where a same-iteration load got 2 plus its own)."""
    if PAGED:
        page = tile_pages(BT, last_page, start, kv_end, offs_n, PAGE_SIZE, BLOCK_N)
    else:
        page = 0
    if WHILE_LOOPS:
        n = start
        while n < end:
            acc, m_i, l_i, page = _kv_tile(
                acc, m_i, l_i, q, K, V, page, n, kv_end, full_start, full_end, k_row0, BT, last_page,
                lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG,
                MASKED, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
            n += BLOCK_N
    else:
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i, page = _kv_tile(
                acc, m_i, l_i, q, K, V, page, n, kv_end, full_start, full_end, k_row0, BT, last_page,
                lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG,
                MASKED, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _kv_tile(
    acc, m_i, l_i, q, K, V, page, n, kv_end, full_start, full_end, k_row0, BT, last_page, lo,
    hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """The KV tile at ``n`` (its block_table entries ``page``), and the next tile's entries,
    loaded before this tile's work (see ``_walk``)."""
    if PAGED:
        next_page = tile_pages(BT, last_page, n + BLOCK_N, kv_end, offs_n, PAGE_SIZE, BLOCK_N)
    else:
        next_page = page
    partial = (n < full_start) | (n + BLOCK_N > full_end)
    rows = kv_rows(page, n, kv_end, k_row0, offs_n, MASKED, PAGED, PAGE_SIZE, BLOCK_N)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, K, V, rows, n + offs_n, lo, hi, stride_kt, stride_vt, offs_d, offs_dv,
        qk_scale, softcap_log2, partial, gsel, KG, kv_end, MASKED, SOFTCAP, HEAD_DIM, D,
        DOT_PRECISION, GROUPS, CLAMP,
    )  # fmt: skip
    return acc, m_i, l_i, next_page


@triton.jit
def _group_piece(
    acc, m_i, l_i, q, K, V, K_DESC, V_DESC, start, end, key_end, k_row0, kv_len, kv_head, dv_part,
    BT, last_page, lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2,
    gsel, KG, SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, DV_SPLIT: tl.constexpr, TMA: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """Masked KV tiles ``[start, end)`` of one group's run (no key at or past ``key_end``): the
    span groups' walks outside a tile's interval range, through TMA or pointers as the rest."""
    if TMA:
        k_col0 = kv_head * D
        acc, m_i, l_i = _walk_tma(
            acc, m_i, l_i, q, start, end, start, start, lo, hi, offs_n, qk_scale, softcap_log2, K_DESC,
            V_DESC, k_row0.to(tl.int32), kv_len - BLOCK_N, k_col0,
            k_col0 + dv_part * (HEAD_DIM // DV_SPLIT), gsel, KG, key_end, 1, SOFTCAP, BLOCK_N,
            DOT_PRECISION, WHILE_LOOPS, True, CLAMP,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _walk(
            acc, m_i, l_i, q, K, V, start, end, key_end, start, start, k_row0, BT, last_page, lo, hi,
            stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG, 1, SOFTCAP,
            HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS, True, CLAMP,
        )  # fmt: skip
    return acc, m_i, l_i


# the block table's width may change per step, and so may the cache's size (num_blocks)
@triton.jit(do_not_specialize=["stride_bt", "last_page"])
def attn_fwd(
    Q,
    K,
    V,
    K_DESC,
    V_DESC,
    OUT,
    LSE,
    LO,
    HI,
    TILE_INFO,
    BLOCK_TABLE,
    Q_GROUP,
    K_GROUP,
    GROUP_RUNS,
    RUNS,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    last_page,
    qk_scale,
    softcap_log2,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
    ONE_LOOP: tl.constexpr,
    DV_SPLIT: tl.constexpr,
    TMA: tl.constexpr,
    N_INFO: tl.constexpr,
    GROUPS: tl.constexpr,
    CLAMP: tl.constexpr,
):
    # Heads vary fastest so that all heads of one (heavy, LPT-ordered) tile run together and
    # share its K/V tiles through L2.
    pid = tl.program_id(0)
    # DV_SPLIT programs share one (tile, head), each owning HEAD_DIM // DV_SPLIT output columns:
    # they recompute the scores (1.5x the FLOPs at 2) but hold half the fp32 accumulator, which
    # is what lets d512 run 128-query tiles on 8 warps.
    dv_part = pid % DV_SPLIT
    pid = pid // DV_SPLIT
    tile = pid // HQ
    head = pid % HQ
    kv_head = head // GROUP

    # One round of independent scalar loads (columns.INFO), then K/V, Q and intervals together.
    info = TILE_INFO + tile * N_INFO
    q_row0 = tl.load(info + Q_ROW0)
    q_row_last = tl.load(info + Q_ROW_LAST)
    k_row0 = tl.load(info + K_ROW0).to(tl.int64)
    kv_len = tl.load(info + KV_LEN)
    seq = tl.load(info + SEQ)
    BT = BLOCK_TABLE + seq.to(tl.int64) * stride_bt  # this sequence's pages (read only if PAGED)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = dv_part * (HEAD_DIM // DV_SPLIT) + tl.arange(0, HEAD_DIM // DV_SPLIT)
    row_ok = q_row0 + offs_m <= q_row_last
    # Rows past the sequence end copy the last row's interval: they compute a harmless duplicate
    # (never stored) instead of an empty row, and do not widen the tile's key range.
    q_idx = tl.minimum(q_row0 + offs_m, q_row_last)
    lo = tl.load(LO + q_idx)
    hi = tl.load(HI + q_idx)
    # Every walked tile starts at a multiple of BLOCK_N: kv_start, full_start and full_end are
    # multiples (full_start = kv_end only leaves the loops after it empty). A paged tile then
    # lies in one page whenever BLOCK_N divides PAGE_SIZE (rows.tile_pages relies on this).
    if TMA:  # from the schedule: the first K/V tiles load without waiting for lo/hi
        kv_start = tl.load(info + KV_START)
        kv_end = tl.load(info + KV_END)
        full_start = tl.load(info + FULL_START)
        full_end = tl.load(info + FULL_END)
    else:  # the same from lo/hi: pointer walks spill at d256 with them loaded (compile_stats)
        # A tile holding no query (a device plan's spare room: q_row0 > q_row_last) walks no key.
        live = q_row0 <= q_row_last
        kv_end = tl.where(live, tl.max(hi) + 1, 0)
        kv_start = (tl.min(lo) // BLOCK_N) * BLOCK_N
        full_start = tl.minimum((tl.max(lo) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, kv_end)
        full_end = tl.where(live, tl.maximum((tl.min(hi) + 1) // BLOCK_N * BLOCK_N, full_start), 0)

    # Span groups (groups.py): rows' groups, and the tile's range of them. The walk of
    # [kv_start, kv_end) masks with the groups too and reads keys up to the sequence end (a
    # tile there may hold keys of a group past kv_end); _group_walks adds the rest.
    if GROUPS:
        gq = tl.load(Q_GROUP + q_idx)
        gsel = tl.where(gq >= 0, gq, -2)
        KG = K_GROUP + k_row0
        key_end = kv_len
    else:
        gsel = lo
        KG = K_GROUP
        key_end = kv_end

    q_rows = q_row0.to(tl.int64) + offs_m
    q_ptrs = Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    if HEAD_DIM != D:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    K += kv_head * stride_kh
    V += kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM // DV_SPLIT], dtype=tl.float32)
    if TMA:
        # Descriptors over the packed [total_k, Hkv * D] keys and values, made on the host (one
        # per launch, none per program). A tile must not run past the sequence end: it would read
        # the next sequence's values, which p = 0 does not cancel when they are inf or NaN. So
        # the tile across the end is read shifted back to end with the sequence (``tma_last``),
        # its keys below ``n`` masked as already seen (forward needs kv_len >= BLOCK_N).
        tma_row0 = k_row0.to(tl.int32)
        tma_last = kv_len - BLOCK_N
        k_col0 = kv_head * D
        v_col0 = k_col0 + dv_part * (HEAD_DIM // DV_SPLIT)
        if ONE_LOOP:
            acc, m_i, l_i = _walk_tma(
                acc, m_i, l_i, q, kv_start, kv_end, full_start, full_end, lo, hi, offs_n, qk_scale,
                softcap_log2, K_DESC, V_DESC, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, 2,
                SOFTCAP, BLOCK_N, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
            )  # fmt: skip
        else:
            acc, m_i, l_i = _walk_tma(
                acc, m_i, l_i, q, kv_start, full_start, full_start, full_end, lo, hi, offs_n, qk_scale,
                softcap_log2, K_DESC, V_DESC, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, 1,
                SOFTCAP, BLOCK_N, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
            )  # fmt: skip
            acc, m_i, l_i = _walk_tma(
                acc, m_i, l_i, q, full_start, full_end, full_start, full_end, lo, hi, offs_n, qk_scale,
                softcap_log2, K_DESC, V_DESC, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, 0,
                SOFTCAP, BLOCK_N, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
            )  # fmt: skip
            acc, m_i, l_i = _walk_tma(
                acc, m_i, l_i, q, full_end, kv_end, full_start, full_end, lo, hi, offs_n, qk_scale,
                softcap_log2, K_DESC, V_DESC, tma_row0, tma_last, k_col0, v_col0, gsel, KG, key_end, 1,
                SOFTCAP, BLOCK_N, DOT_PRECISION, WHILE_LOOPS, GROUPS, CLAMP,
            )  # fmt: skip
    elif ONE_LOOP:
        # One pipelined loop, each tile masked or not at run time: fewer pipeline fills when
        # a tile's key range is only a few tiles long (sliding windows).
        acc, m_i, l_i = _walk(
            acc, m_i, l_i, q, K, V, kv_start, kv_end, key_end, full_start, full_end, k_row0, BT,
            last_page, lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2,
            gsel, KG, 2, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS,
            GROUPS, CLAMP,
        )  # fmt: skip
    else:
        # PARTIAL tiles before the FULL range (sliding windows, non-causal rows, span starts).
        acc, m_i, l_i = _walk(
            acc, m_i, l_i, q, K, V, kv_start, full_start, key_end, full_start, full_end, k_row0, BT,
            last_page, lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2,
            gsel, KG, 1, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS,
            GROUPS, CLAMP,
        )  # fmt: skip
        # FULL tiles: every (row, key) pair allowed and in bounds.
        acc, m_i, l_i = _walk(
            acc, m_i, l_i, q, K, V, full_start, full_end, key_end, full_start, full_end, k_row0, BT,
            last_page, lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2,
            gsel, KG, 0, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS,
            GROUPS, CLAMP,
        )  # fmt: skip
        # PARTIAL tiles after it (the causal diagonal, span ends, chunk ends).
        acc, m_i, l_i = _walk(
            acc, m_i, l_i, q, K, V, full_end, kv_end, key_end, full_start, full_end, k_row0, BT,
            last_page, lo, hi, stride_kt, stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2,
            gsel, KG, 1, SOFTCAP, HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS,
            GROUPS, CLAMP,
        )  # fmt: skip

    if GROUPS:
        # Keys of the rows' groups outside [kv_start, kv_end): each group's tile runs
        # (groups.tile_runs) minus the tiles walked above, every tile read once per group and
        # masked to that group's rows, so a tile holding keys of two groups counts each pair once.
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
                        acc, m_i, l_i = _group_piece(
                            acc, m_i, l_i, q, K, V, K_DESC, V_DESC, a, tl.minimum(b, kv_start), b,
                            k_row0, kv_len, kv_head, dv_part, BT, last_page, lo, hi, stride_kt,
                            stride_vt, offs_n, offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG, SOFTCAP,
                            HEAD_DIM, D, BLOCK_N, PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS, DV_SPLIT,
                            TMA, CLAMP,
                        )  # fmt: skip
                    acc, m_i, l_i = _group_piece(
                        acc, m_i, l_i, q, K, V, K_DESC, V_DESC, tl.maximum(a, main_end), b, b, k_row0,
                        kv_len, kv_head, dv_part, BT, last_page, lo, hi, stride_kt, stride_vt, offs_n,
                        offs_d, offs_dv, qk_scale, softcap_log2, gsel, KG, SOFTCAP, HEAD_DIM, D, BLOCK_N,
                        PAGED, PAGE_SIZE, DOT_PRECISION, WHILE_LOOPS, DV_SPLIT, TMA, CLAMP,
                    )  # fmt: skip
                    r += 1
            g += 1

    # Every row allows k = q, so l_i > 0 for stored rows.
    acc = acc / l_i[:, None]
    o_ptrs = OUT + q_rows[:, None] * stride_ot + head * stride_oh + offs_dv[None, :]
    if HEAD_DIM != D:
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D))
    else:
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        tl.store(LSE + q_rows * HQ + head, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row_ok)  # ln 2
