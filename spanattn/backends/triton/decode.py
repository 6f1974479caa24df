"""Split-KV decode (flash-decoding): few queries per sequence over long KV, paged or packed.

One program = one sequence x one KV head x one split of the sequence's key range. It stacks the
sequence's ``q_len`` queries of all ``GROUP`` query heads that share the KV head into one
``BLOCK_M`` tile (row ``m`` is query ``m // GROUP`` of head ``kv_head * GROUP + m % GROUP``), so
every K/V byte is read once per KV head, and walks its share of ``[min lo, max hi]`` of those
queries. With one split it writes the output; with several it writes fp32 partials and their
log-sum-exp, and ``_merge_splits`` combines them (the same algebra as spanattn.merge).

CUDA graphs: everything that changes between steps (lengths, intervals, block tables) is read
from device tensors inside the kernel, each split divides whatever range it finds, and the
constexprs depend only on the model and ``max q_len``. The number of splits comes from the
batch's shape and host-side lengths, so it is fixed for a captured graph and only costs speed
(never correctness) when a replayed step has other lengths.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .configs import next_pow2
from .mask import tile_mask
from .scales import kernel_scales

# The interpreter cannot take loaded scalars as range() bounds under numpy >= 2.4 (int() of a
# 1-element array); it walks the same tiles with a while loop, which triton would not pipeline.
INTERPRETED = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else False
MAX_Q_LEN = 16  # speculative / diffusion blocks; longer rows go to the prefill kernel
MAX_ROWS = 128  # q_len * GROUP stacked in one tile
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256  # below this a split's fixed cost (partials, merge) outweighs its keys
PROGRAMS_PER_SM = 32  # work items per SM the split size aims for (D1 on H200: ~2k keys best)


@triton.jit
def _decode_tile(
    acc, m_i, l_i, q, K, V, n, kv_hi, lo, hi, k_row0, seq, BLOCK_TABLE, stride_bt, last_page,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap_log2, gsel, KG,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    """Keys ``[n, n + BLOCK_N)`` of the online softmax, in the log2 domain (exp2 is one op)."""
    kv_idx = n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # Clamp addresses, not loads: keys past kv_hi re-read the last key (cached) and are masked
    # out of the scores, so every load is unpredicated along the keys.
    pos = tl.minimum(kv_idx, kv_hi)
    if PAGED:  # ids clamped into the cache: a table read before its check raises stays inside it
        page = tl.load(BLOCK_TABLE + seq.to(tl.int64) * stride_bt + pos // PAGE_SIZE)
        page = tl.minimum(tl.maximum(page, 0), last_page).to(tl.int64)
        k_off = page * stride_kb + (pos % PAGE_SIZE) * stride_kt
        v_off = page * stride_vb + (pos % PAGE_SIZE) * stride_vt
    else:
        k_off = (k_row0 + pos) * stride_kt
        v_off = (k_row0 + pos) * stride_vt
    if HEAD_DIM != D:  # head_dim padded to a power of two: pad columns read as zero
        k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    else:
        k = tl.load(K + k_off[:, None] + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:  # c * tanh(x): tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1
        s = (1.0 - 2.0 / (tl.exp2(s * qk_scale * 2.8853900817779268) + 1.0)) * softcap_log2
    else:
        s = s * qk_scale
    s = tl.where(tile_mask(kv_idx, lo, hi, gsel, KG, 0, kv_hi + 1, GROUPS, CLAMP), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may have no allowed key in this split yet (windows, padding rows): keep exp2 away
    # from (-inf) - (-inf).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HEAD_DIM != D:
        v = tl.load(V + v_off[:, None] + offs_d[None, :], mask=offs_d[None, :] < D, other=0.0)
    else:
        v = tl.load(V + v_off[:, None] + offs_d[None, :])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# scalars that change from step to step (triton would specialize on = 1 and % 16)
RUNTIME_ARGS = ["stride_bt", "last_page", "stride_ls", "num_splits", "min_split_tiles"]


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _decode_split(
    Q, K, V, OUT, LSE, OUT_PART, LSE_PART, LO, HI, CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_TABLE,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt, last_page, stride_ls,
    num_splits, min_split_tiles, qk_scale, softcap_log2, Q_GROUP, K_GROUP, GROUP_EXTENT,
    HQ: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, RETURN_LSE: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, GROUPS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    seq = pid // (HQ // GROUP)
    kv_head = pid % (HQ // GROUP)
    split = tl.program_id(1)

    q_row0 = tl.load(CU_SEQLENS_Q + seq)
    q_len = tl.load(CU_SEQLENS_Q + seq + 1) - q_row0
    offs_m = tl.arange(0, BLOCK_M)
    q_i = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = q_i < q_len
    tok = (q_row0 + tl.minimum(q_i, q_len - 1)).to(tl.int64)
    # Padding rows borrow the last query's interval: they never widen the key range. A sequence
    # without queries (a device plan's padding; there tok = q_row0 - 1) reads none and walks the
    # empty range.
    has_q = tok >= q_row0
    lo = tl.load(LO + tok, mask=has_q, other=0)
    hi = tl.load(HI + tok, mask=has_q, other=-1)
    kv_hi = tl.max(hi)
    kv_start = (tl.min(lo) // BLOCK_N) * BLOCK_N
    if GROUPS:
        # Span groups: the splits divide the hull of the rows' intervals and their groups' keys
        # (each tile masked with the groups; decode rows inside a group are rare, so tiles
        # between a group's spans are walked rather than skipped as the prefill kernel does).
        gq = tl.load(Q_GROUP + tok, mask=has_q, other=-1)
        gsel = tl.where(gq >= 0, gq, -2)
        k_base = tl.load(CU_SEQLENS_K + seq)
        KG = K_GROUP + k_base
        g_first = tl.load(GROUP_EXTENT + 2 * gq, mask=gq >= 0, other=2147483647)
        g_last = tl.load(GROUP_EXTENT + 2 * gq + 1, mask=gq >= 0, other=-1)
        kv_hi = tl.maximum(kv_hi, tl.max(g_last) - k_base)
        if not CLAMP:  # clamp rows see no group key below their lo
            kv_start = tl.minimum(kv_start, (tl.maximum(tl.min(g_first) - k_base, 0) // BLOCK_N) * BLOCK_N)
    else:
        gsel = lo
        KG = K_GROUP
    n_tiles = tl.cdiv(kv_hi + 1 - kv_start, BLOCK_N)
    # At least min_split_tiles per split (uniform work across sequences; trailing splits of
    # short sequences find nothing and only write an empty partial), and enough that the
    # num_splits splits cover the whole range whatever its length: a captured graph replays
    # correctly for steps longer than the one it was captured on.
    per_split = tl.maximum(tl.cdiv(n_tiles, num_splits), min_split_tiles)
    n_begin = kv_start + split * per_split * BLOCK_N
    n_end = tl.minimum(n_begin + per_split * BLOCK_N, kv_hi + 1)

    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < D
    q_ptrs = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if PAGED:
        k_row0 = 0
    else:
        k_row0 = tl.load(CU_SEQLENS_K + seq).to(tl.int64)
    K += kv_head * stride_kh
    V += kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if WHILE_LOOPS:
        n = n_begin
        while n < n_end:
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, K, V, n, kv_hi, lo, hi, k_row0, seq, BLOCK_TABLE, stride_bt,
                last_page, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap_log2, gsel, KG,
                BLOCK_N, HEAD_DIM, D, SOFTCAP, PAGED, PAGE_SIZE, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip
            n += BLOCK_N
    else:
        for n in range(n_begin, n_end, BLOCK_N):
            acc, m_i, l_i = _decode_tile(
                acc, m_i, l_i, q, K, V, n, kv_hi, lo, hi, k_row0, seq, BLOCK_TABLE, stride_bt,
                last_page, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap_log2, gsel, KG,
                BLOCK_N, HEAD_DIM, D, SOFTCAP, PAGED, PAGE_SIZE, DOT_PRECISION, GROUPS, CLAMP,
            )  # fmt: skip

    empty = l_i == 0.0
    if SPLIT:  # a split may hold no key of a row: an empty partial, weight 0 in the merge
        acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    else:  # every row allows k = q; only a device plan's rejected sequence has none: NaN
        acc = acc / l_i[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    store = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        rows = split * stride_ls + tok * HQ + head
        tl.store(OUT_PART + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store)
        tl.store(LSE_PART + rows, lse, mask=row_ok)
    else:
        o_ptrs = OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=store)
        if RETURN_LSE:
            tl.store(LSE + tok * HQ + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["stride_ls", "num_splits"])
def _merge_splits(
    OUT_PART, LSE_PART, OUT, LSE, stride_ls, stride_ot, stride_oh, num_splits,
    HQ: tl.constexpr, HEAD_DIM: tl.constexpr, D: tl.constexpr, RETURN_LSE: tl.constexpr,
):  # fmt: skip
    """One program per (query, head): fold the splits' partials by their log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)  # = token * HQ + head
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    s = 0
    while s < num_splits:  # a while loop: the interpreter takes no tensor range() bounds
        lse_s = tl.load(LSE_PART + s * stride_ls + row + tl.zeros([1], dtype=tl.int64))
        m_new = tl.maximum(m, lse_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(lse_s - m_use)
        o_s = tl.load(OUT_PART + (s * stride_ls + row) * HEAD_DIM + offs_d)
        acc = acc * alpha + w * o_s
        l_sum = l_sum * alpha + w
        m = m_new
        s += 1
    # Every query allows k = q, so at least one split is non-empty and l_sum > 0.
    token = row // HQ
    head = row % HQ
    tl.store(
        OUT + token * stride_ot + head * stride_oh + offs_d,
        (acc / l_sum).to(OUT.dtype.element_ty),
        mask=offs_d < D,
    )
    if RETURN_LSE:
        tl.store(LSE + row + tl.zeros([1], dtype=tl.int64), m + tl.log(l_sum))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: enough to exercise splits in tests


def suited(plan, group: int = 1) -> bool:
    """True when every row of the batch is decode-shaped: short query blocks, all heads of a
    KV head stacked in one tile."""
    q = plan.max_seqlen_q
    return q <= MAX_Q_LEN and q * group <= MAX_ROWS


def choose_splits(plan, kv_heads: int, device, split_keys: int | None = None) -> tuple[int, int]:
    """``(num_splits, split_keys)``: cut the step's K/V into pieces of about ``split_keys`` keys,
    enough of them for ``PROGRAMS_PER_SM`` programs per SM, so that long and short sequences mix
    into uniform work and the last wave is short. Pieces smaller than MIN_SPLIT_KEYS cost more in
    partials and merging than they save."""
    if split_keys is None:
        work = plan.total_k * kv_heads
        split_keys = max(-(-work // (PROGRAMS_PER_SM * _sm_count(torch.device(device)))), MIN_SPLIT_KEYS)
    return max(1, min(-(-plan.max_seqlen_k // split_keys), MAX_SPLITS)), split_keys


def _config(head_dim: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages), from a sweep on D1 (H200, benchmarks/README.md): K and V
    tiles of 16-32 KB, 2-3 stages in flight. d512 is unmeasured (tiles kept at 16 KB)."""
    if interpreted:  # CPU tests: small tiles cross more page and split edges
        return 16, 4, 1
    if head_dim <= 128:
        return 64, 4, 3
    if head_dim <= 256:
        return 64, 4, 2
    return 16, 4, 2


def decode_forward(
    q, k, v, plan, *, scale, softcap=None, return_lse=False, block_table=None,
    page_size=None, split_keys=None, config=None, out=None,
):  # fmt: skip
    """Attention of decode-shaped rows (see :func:`suited`). ``k, v`` are packed
    ``[total_k, Hkv, D]`` or, with ``block_table``, caches ``[num_blocks, block_size, Hkv, D]``
    (or viewed flat ``[num_blocks * page_size, Hkv, D]`` with ``page_size``).
    Returns ``(out, lse or None)``. No host sync; safe to capture in a CUDA graph.

    split_keys, config: override the automatic split size (keys per program; with a huge value
        each sequence takes one program) and ``(BLOCK_N, warps, stages)``.
    out: a preallocated output (tests poison it)."""
    if block_table is not None and k.dim() == 3:
        if not page_size:
            raise ValueError("flat paged K/V needs page_size")
        k, v = k.unflatten(0, (-1, page_size)), v.unflatten(0, (-1, page_size))
    launch = DecodeLaunch(q, k, v, plan, softcap=bool(softcap), return_lse=return_lse,
                          paged=block_table is not None, split_keys=split_keys, config=config)  # fmt: skip
    return launch(q, k, v, scale, softcap, block_table, out)


class DecodeLaunch:
    """What ``decode_forward`` decides for one call shape (splits, tiles, the launches), kept
    by callers that repeat it: ``k, v`` as caches ``[num_blocks, block_size, Hkv, D]`` when
    ``paged``; the tensors given stand for every later call's (same shapes, strides, dtypes,
    16-byte alignment).

    >>> launch = DecodeLaunch(q, k, v, plan, softcap=False, return_lse=False)  # doctest: +SKIP
    >>> out, lse = launch(q, k, v, scale=0.125)  # doctest: +SKIP
    """

    def __init__(self, q, k, v, plan, *, softcap: bool, return_lse: bool, paged: bool = False,
                 split_keys=None, config=None):  # fmt: skip
        from .direct_launch import DirectLaunch

        total_q, hq, d = q.shape
        hkv = k.shape[-2]
        group = hq // hkv
        if not suited(plan, group):
            raise ValueError(f"decode_forward takes q_len <= {MAX_Q_LEN} and q_len * group <= {MAX_ROWS}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension")
        block_n, warps, stages = config or _config(d, INTERPRETED)
        splits, split_keys = choose_splits(plan, hkv, q.device, split_keys)
        head_dim = next_pow2(d)
        block_m = max(16, next_pow2(plan.max_seqlen_q * group))
        # The plan's tensors, not the plan: kept on the plan, this would make a reference cycle.
        self.plan_tensors = (plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k)
        self.seq_lens, self.paged, self.return_lse, self.splits = plan.seq_lens, paged, return_lse, splits
        self.part_shape = (splits, total_q, hq, head_dim)
        if paged:
            kb, kt, kh = k.stride()[:3]
            vb, vt, vh = v.stride()[:3]
            page, last_page = k.shape[1], k.shape[0] - 1
        else:
            (kt, kh), (vt, vh), kb = k.stride()[:2], v.stride()[:2], 0
            vb, page, last_page = 0, 1, 0
        self.strides = (q.stride(0), q.stride(1), kb, kt, kh, vb, vt, vh)
        self.split_args = (last_page, total_q * hq, splits, -(-split_keys // block_n))
        groups = plan.groups
        self.group_tensors = (
            (plan.lo,) * 3 if groups is None else (groups.q_group, groups.k_group, groups.extents)
        )
        self.decode = DirectLaunch(_decode_split, (plan.num_seqs * hkv, splits), dict(
            HQ=hq, GROUP=group, HEAD_DIM=head_dim, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
            SOFTCAP=softcap, RETURN_LSE=return_lse, PAGED=paged, PAGE_SIZE=page,
            SPLIT=splits > 1, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            WHILE_LOOPS=INTERPRETED, GROUPS=groups is not None, CLAMP=groups is not None and groups.clamp,
            num_warps=warps, num_stages=stages,
        ))  # fmt: skip
        self.merge = DirectLaunch(_merge_splits, (total_q * hq,), dict(
            HQ=hq, HEAD_DIM=head_dim, D=d, RETURN_LSE=return_lse, num_warps=1 if head_dim <= 128 else 2,
        ))  # fmt: skip

    def __call__(self, q, k, v, scale: float, softcap=None, block_table=None, out=None):
        """``(out, lse or None)``."""
        total_q, hq = q.shape[0], q.shape[1]
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device) if self.return_lse else None
        if self.splits > 1:
            o_part = torch.empty(self.part_shape, dtype=torch.float32, device=q.device)
            lse_part = torch.empty(self.part_shape[:3], dtype=torch.float32, device=q.device)
        else:
            o_part = lse_part = out  # unused
        bt, bt_stride = (block_table, block_table.stride(0)) if self.paged else (self.seq_lens, 0)
        self.decode(
            q, k, v, out, lse if lse is not None else out, o_part, lse_part, *self.plan_tensors, bt,
            *self.strides, out.stride(0), out.stride(1), bt_stride, *self.split_args,
            *kernel_scales(scale, softcap), *self.group_tensors,
        )  # fmt: skip
        if self.splits > 1:
            self.merge(
                o_part, lse_part, out, lse if lse is not None else out, total_q * hq, out.stride(0),
                out.stride(1), self.splits,
            )  # fmt: skip
        return out, lse
