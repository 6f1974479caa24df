"""What the two Gluon prefill kernels share (kernel_gluon.py splits a 128-query tile's rows over
two consumer warpgroups, kernel_gluon_split.py a 64-query tile's head_dim): the TMA producer
warp (packed or paged K/V), one tile's online-softmax step and the epilogue. Hopper (sm_90)
only."""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

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
)
from .gluon_compat import partition_barrier, tma_load
from .gluon_deal import (
    Counters,
    PerStream,
    finish,
    item_place,
    kv_head_bytes,
    kv_heads_per_section,
    l2_bytes,
    next_item,
    publish,
)
from .gluon_halves import WARPS_PER_ITEM, halve_walk, halved_items, partials_numel, unit_item
from .gluon_rescale import lazy_max
from .tma_layout import rebased, tma_matrix

# Triton versions the Gluon kernels were checked on, on an H200. Gluon is experimental and
# changes between releases (triton 3.9 renamed the TMA copy); the kernels compile for sm_90 on
# 3.9 as well (tests/test_kernels_compile.py). On other versions they run once they pass their
# first-use self-check (gluon_check.py).
CHECKED_TRITON = ("3.6.",)

# Registers a thread of the consumer warpgroups / of the producer warp holds (setmaxnreg).
CONSUMER_REGS, PRODUCER_REGS = 240, 24


def checked_triton() -> bool:
    """Is the installed triton one the Gluon kernels were checked on?"""
    return triton.__version__.startswith(CHECKED_TRITON)


def descriptors(q, k, v, q_rows: int, kv_rows: int, cols: int):
    """Host TMA descriptors of ``q``, ``k``, ``v [tokens, heads, D]`` read in ``q_rows x cols`` /
    ``kv_rows x cols`` boxes, and where head ``h`` starts in each matrix (tma_layout.py): rows
    ``h * head_rows`` down, columns ``h * head_cols`` across, for q and for K/V (alike)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    mq, mk, mv = tma_matrix(q), tma_matrix(k), tma_matrix(v)

    def desc(m, rows):
        layout = smem_layout(rows, cols, q.dtype)
        return TensorDescriptor(m, list(m.shape), list(m.stride()), [rows, cols], layout)

    boxes = desc(mq.matrix, q_rows), desc(mk.matrix, kv_rows), desc(mv.matrix, kv_rows)
    return boxes, (mq.head_rows, mq.head_cols, mk.head_rows, mk.head_cols)


@functools.cache  # a few microseconds of host time per descriptor otherwise, every call
def smem_layout(rows: int, cols: int, dtype: torch.dtype):
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], el)


class GluonLaunch:
    """Gluon ``kernel`` (``attn_fwd_gluon``'s arguments) over ``q [total_q, Hq, D]`` and ``k, v
    [total_k, Hkv, D]`` (see ``uses_gluon``), or flat paged caches ``k, v [num_pages * page_size,
    Hkv, D]`` read through a block table: a work item per ``tile_rows``-query tile of the
    schedule and head, dealt as the programs go (gluon_deal.py: in sections of KV heads whose K/V
    fit in L2) to one program per SM (``persistent``; else one per item, each taking just its
    own), Q read in ``q_rows``-row boxes, K/V tiles in ``pieces`` boxes side by side (of
    ``block_n`` rows, or ``min(page_size, block_n)`` over pages). ``groups``: the plan's span
    groups as (query groups, key groups, key tile groups, the schedule's group walk), see
    group_walk.py; None without. ``halve_tail(head_dim)``: does the kernel take the launch's
    last items in halves at that head_dim (gluon_halves.py; done on steps without span groups)?

    Made once per call shape (the tensors given here stand for every later call's: same shapes,
    strides, dtypes, 16-byte alignment; ``out_strides``: their outputs'); each call then
    rebases the descriptors and launches (direct_launch.py).

    >>> launch = kernel_gluon.launch(q, k, v, plan, sched, out.stride(), True, False, 2)  # doctest: +SKIP
    >>> launch(q, k, v, out, lse, qk_scale, 1.0)  # doctest: +SKIP
    """

    def __init__(self, kernel, tile_rows: int, q_rows: int, pieces: int, q, k, v, plan, sched, out_strides,
                 return_lse: bool, softcap: bool, stages: int, paged: bool = False, page_size: int = 0,
                 bt_stride: int = 0, groups: tuple | None = None, persistent: bool = True,
                 halve_tail=lambda head_dim: False):  # fmt: skip
        from .direct_launch import DirectLaunch

        assert sched.block_m == tile_rows
        hq, d = q.shape[1], q.shape[2]
        kv_rows = min(page_size, sched.block_n) if paged else sched.block_n
        self.boxes, heads_at = descriptors(q, k, v, q_rows, kv_rows, d // pieces)
        self.paged = paged
        self.pages = (bt_stride, k.shape[0] // page_size - 1) if paged else (0, 0)
        items = sched.num_tiles * hq
        # The same items halved with one program per item as with one per SM: the same outputs.
        self.halves = halved_items(items, sm_count(q.device)) if halve_tail(d) and groups is None else 0
        units = items + self.halves
        programs = min(units, sm_count(q.device)) if persistent else units
        # Every argument but the call's tensors and scales, in the kernel's order around them.
        self.plan_args = (plan.lo, plan.hi, sched.info, *out_strides[:2])
        self.heads_at = heads_at
        self.group_args = (*(groups or (plan.lo,) * 4), units)
        head_bytes = kv_head_bytes(plan.total_k, d, k.element_size())
        self.section = kv_heads_per_section(k.shape[1], head_bytes, l2_bytes(q.device))
        self.counters = Counters(q.device, flags=WARPS_PER_ITEM.value * self.halves)
        numel = partials_numel(self.halves, d)  # per stream, as the counters
        self.partials = PerStream(q.device, lambda: torch.empty(numel, dtype=torch.float32, device=q.device))
        self.seq_lens = plan.seq_lens
        self.launch = DirectLaunch(kernel, (max(programs, 1),), dict(
            HQ=hq, GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_N=sched.block_n, STAGES=stages,
            SOFTCAP=softcap, RETURN_LSE=return_lse, N_INFO=len(INFO), PAGE=page_size if paged else 0,
            GROUPS=groups is not None, CLAMP=groups is not None and plan.groups.clamp,
            CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
        ))  # fmt: skip

    def __call__(self, q, k, v, out, lse, qk_scale: float, softcap_log2: float, block_table=None) -> None:
        bq, bk, bv = self.boxes
        self.launch(
            rebased(bq, q), rebased(bk, k), rebased(bv, v), out, lse if lse is not None else out,
            *self.plan_args, qk_scale, softcap_log2, *self.heads_at,
            block_table if self.paged else self.seq_lens, *self.pages, *self.group_args,
            self.counters(), self.section, self.halves, self.partials(),
        )  # fmt: skip


@functools.cache  # a device property query costs microseconds of host time per call
def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@gluon.jit
def tile_walk(TILE_INFO, BT, stride_bt, WALK_INFO, unit, num_units, section, halves, HQ: gl.constexpr,
              GROUP: gl.constexpr, N_INFO: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
              GROUPS: gl.constexpr):  # fmt: skip
    """Deal unit ``unit``'s work item's head, its KV head, and its query tile's row of the
    schedule table (columns.INFO), read in one round: the tile's first and last query rows, its
    sequence's first key row (packed) and length, the interval walk from ``kv_start`` with FULL
    tiles in ``[full_start, full_end)``, where the tile across the sequence end starts
    (``tma_last``: shifted back to end with the sequence on packed K/V, read in place over
    pages), the sequence's page numbers, and the whole walk: ``num_tiles`` key tiles, of which
    ``n_pre`` from ``pre_start`` come first and those after ``n_pre + n_main`` from
    ``post_start`` (span groups, columns.WALK; without, the interval walk alone). No key tiles
    for a device plan's empty tile (its interval walk ends before it starts). Items in sections
    of ``section`` KV heads (gluon_deal.item_place); the last ``halves`` as two units each, a
    unit walking one half of the interval walk (gluon_halves: ``half`` 0 or 1, and the halved
    item's index ``pair``; ``half`` -1 for a whole item; never with span groups)."""
    item, half, pair = unit_item(unit, num_units, halves)
    tile, head = item_place(item, num_units - halves, section, HQ, GROUP)
    info = TILE_INFO + tile * N_INFO
    q_row0 = gl.load(info + Q_ROW0)
    q_row_last = gl.load(info + Q_ROW_LAST)
    tma_row0 = gl.load(info + K_ROW0)
    kv_len = gl.load(info + KV_LEN)
    kv_start = gl.load(info + KV_START)
    kv_end = gl.load(info + KV_END)
    full_start = gl.load(info + FULL_START)
    full_end = gl.load(info + FULL_END)
    if PAGE == 0:
        tma_last = kv_len - BLOCK_N
    else:
        tma_last = kv_len
    pages = BT + gl.load(info + SEQ).to(gl.int64) * stride_bt
    n_main = (kv_end - kv_start + BLOCK_N - 1) // BLOCK_N
    if not GROUPS:
        kv_start, n_main = halve_walk(kv_start, n_main, half, BLOCK_N)
    n_pre = n_main * 0
    pre_start = n_pre
    post_start = n_pre
    num_tiles = n_main
    if GROUPS:
        walk_row = WALK_INFO + tile * N_WALK
        pre_start = gl.load(walk_row + PRE_START)
        n_pre = gl.load(walk_row + PRE_TILES)
        post_start = gl.load(walk_row + POST_START)
        num_tiles = n_pre + n_main + gl.load(walk_row + POST_TILES)
    num_tiles = gl.where(n_main > 0, num_tiles, 0)
    walk = (q_row0, q_row_last, tma_row0, kv_len, kv_start, full_start, full_end, tma_last, num_tiles)
    return (head, head // GROUP) + walk + (pages, n_pre, pre_start, n_main, post_start, half, pair)


@gluon.jit
def key_tile(t, kv_start, n_pre, pre_start, n_main, post_start, BLOCK_N: gl.constexpr,
             GROUPS: gl.constexpr):  # fmt: skip
    """The first key of tile ``t`` of the walk (tile_walk)."""
    n = kv_start + t * BLOCK_N
    if GROUPS:
        n = kv_start + (t - n_pre) * BLOCK_N
        if t < n_pre:
            n = pre_start + t * BLOCK_N
        elif t >= n_pre + n_main:
            n = post_start + (t - n_pre - n_main) * BLOCK_N
    return n


@gluon.jit
def key_tile_group(KT, n, kv_len, BLOCK_N: gl.constexpr, GROUPS: gl.constexpr):
    """Key tile ``n ...``'s group code (group_walk.key_tile_groups; ``KT`` at the sequence's
    first key row), -1 if none or the tile crosses the sequence end. Loaded at the top of a
    consumer's step so that its latency hides under the tile's MMAs."""
    g = n
    if GROUPS:
        g = gl.load(KT + gl.minimum(n, kv_len - BLOCK_N))
        g = gl.where(n + BLOCK_N <= kv_len, g, -1)
    return g


@gluon.jit
def tile_place(t, KT, kv_start, n_pre, pre_start, n_main, post_start, kv_len, BLOCK_N: gl.constexpr,
               GROUPS: gl.constexpr):  # fmt: skip
    """What a consumer's softmax needs to know of key tile ``t``: its first key, its group code
    (key_tile_group) and whether it lies outside the interval walk (group_mask's ``outside``)."""
    n = key_tile(t, kv_start, n_pre, pre_start, n_main, post_start, BLOCK_N, GROUPS)
    ktg = key_tile_group(KT, n, kv_len, BLOCK_N, GROUPS)
    return n, ktg, (t < n_pre) | (t >= n_pre + n_main)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The mbarriers ``produce`` and the consumers share: Q's ``ready`` (the TMA transaction) and
    ``empty`` (one arrival per consumer: its item's Q @ K^T are done), the held-back last V
    tile's, per K (V) slot ``ready``, and per slot ``done``: one arrival per consumer at the end
    of each key tile ``u`` of the program's walk, on slot ``u % STAGES``'s, saying that tile
    ``u``'s keys and tile ``u - 1``'s values are read (the consumers read V one tile late). One
    barrier for both: Gluon puts a barrier of the warpgroup's threads before every arrive, so
    separate K and V releases cost two such barriers a tile."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    v_loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    mbarrier.init(v_loaded, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(done.index(i), count=2)
    return q_bar, q_empty, v_loaded, k_ready, v_ready, done


@gluon.jit
def produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, done,
            v_loaded, items, full, free, TILE_INFO, BT, stride_bt, last_page,
            WALK_INFO, num_items, DEAL, section, halves, q_head_rows, q_head_cols, kv_head_rows,
            kv_head_cols, HQ: gl.constexpr, GROUP: gl.constexpr, N_INFO: gl.constexpr,
            Q_ROW_STEP: gl.constexpr, Q_COL_STEP: gl.constexpr, PIECES: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, PAGE: gl.constexpr, GROUPS: gl.constexpr):  # fmt: skip
    """The producer warp, over the work items it takes (gluon_deal: the first is the program's number,
    the next asked for once an item's last loads are issued; each handed to the consumers through
    ``items``, then one past the last, which ends their loops). Per item: its Q, as two boxes
    ``Q_ROW_STEP`` rows / ``Q_COL_STEP`` columns apart, once both consumers are done with the
    previous item's (so it loads under their last P @ V and output stores); then K (V)
    tile ``t`` of the walk, as ``PIECES`` boxes side by side, into K (V) slot ``c % STAGES`` (``c``
    counts the program's tiles over all its items; shared memory index ``slot * PIECES + piece``)
    as soon as both consumers released the tile that held it before, tiles in the walk's order
    (key_tile), running ahead into the next item. Q rows past the sequence end read the next rows
    (never stored). Packed K/V (``PAGE`` 0): the tile across the sequence end is read shifted back
    to end with the sequence. Paged K/V: see ``_load_tile``; that tile's values past the end are
    zeroed before the consumers may read them (``v_loaded`` holds them back until then)."""
    boxes: gl.constexpr = PIECES * (BLOCK_N // k_desc.block_type.shape[0])
    c = 0  # key tiles loaded, over all items
    i = 0  # items loaded
    ends = 0  # tiles held back by v_loaded
    r = 0  # items taken
    item = gl.program_id(0)
    while item < num_items:
        publish(items, full, free, item, r)
        head, kv_head, q_row0, q_row_last, tma_row0, kv_len, kv_start, full_start, full_end, tma_last, \
            num_tiles, pages, n_pre, pre_start, n_main, post_start, _, _ = tile_walk(
                TILE_INFO, BT, stride_bt, WALK_INFO, item, num_items, section, halves, HQ, GROUP,
                N_INFO, BLOCK_N, PAGE, GROUPS)  # fmt: skip
        if num_tiles > 0:
            mbarrier.wait(q_empty, (i - 1) & 1, pred=i > 0)
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            for j in gl.static_range(2):
                at = [q_row0 + head * q_head_rows + j * Q_ROW_STEP, head * q_head_cols + j * Q_COL_STEP]
                tma_load(q_desc, at, q_bar, q_smem.index(j))
            kv_row = tma_row0 + kv_head * kv_head_rows
            kv_col = kv_head * kv_head_cols
            for t in range(num_tiles):
                slot = (c + t) % STAGES
                reuse = ((c + t) // STAGES - 1) & 1
                n = key_tile(t, kv_start, n_pre, pre_start, n_main, post_start, BLOCK_N, GROUPS)
                # K slot: free once tile c + t - STAGES ended; V slot: once the tile after it ended
                # (ring_barriers' done).
                mbarrier.wait(done.index(slot), reuse, pred=c + t >= STAGES)
                mbarrier.expect(k_ready.index(slot), boxes * k_desc.block_type.nbytes)
                _load_tile(k_desc, k_ready.index(slot), k_smem, slot, n, kv_row, tma_last, kv_col,
                           pages, last_page, kv_len, PIECES, BLOCK_N, PAGE)  # fmt: skip
                after = c + t - STAGES + 1
                mbarrier.wait(done.index(after % STAGES), (after // STAGES) & 1, pred=c + t >= STAGES)
                past_end = False
                if PAGE != 0:
                    past_end = n + BLOCK_N > kv_len
                if past_end:  # paged: keys past the end are masked, but their values must be finite
                    mbarrier.expect(v_loaded, boxes * v_desc.block_type.nbytes)
                    _load_tile(v_desc, v_loaded, v_smem, slot, n, kv_row, tma_last, kv_col, pages,
                               last_page, kv_len, PIECES, BLOCK_N, PAGE)  # fmt: skip
                    mbarrier.wait(v_loaded, ends & 1)
                    ends += 1
                    zero_rows_from(v_smem, slot, kv_len - n, PIECES, BLOCK_N)
                    fence_async_shared()  # generic-proxy stores before the consumers' MMAs read them
                    partition_barrier()
                    mbarrier.arrive(v_ready.index(slot))
                else:
                    mbarrier.expect(v_ready.index(slot), boxes * v_desc.block_type.nbytes)
                    _load_tile(v_desc, v_ready.index(slot), v_smem, slot, n, kv_row, tma_last,
                               kv_col, pages, last_page, kv_len, PIECES, BLOCK_N, PAGE)  # fmt: skip
            c += num_tiles
            i += 1
        item = next_item(DEAL)
        r += 1
    publish(items, full, free, item, r)
    finish(DEAL)


@gluon.jit
def _load_tile(desc, bar, smem, slot, n, tma_row0, tma_last, kv_col, pages, last_page, kv_len,
               PIECES: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr):  # fmt: skip
    """Keys (values) ``n ... n + BLOCK_N`` into ``smem`` slot ``slot``. Packed: one box per
    piece, the tile shifted back to end with the sequence. Paged (``PAGE`` tokens per page, the
    sequence's page numbers at ``pages``, clamped into ``[0, last_page]`` so that a bad table run
    before its check raises reads inside the cache): boxes of ``min(PAGE, BLOCK_N)`` rows, each
    inside one page; a box starting past the sequence's end reads its last box again (never used)."""
    width: gl.constexpr = desc.block_type.shape[1]
    if PAGE == 0:
        row = tma_row0 + gl.minimum(n, tma_last)
        for i in gl.static_range(PIECES):
            tma_load(desc, [row, kv_col + i * width], bar, smem.index(slot * PIECES + i))
    else:
        sub: gl.constexpr = desc.block_type.shape[0]
        for j in gl.static_range(BLOCK_N // sub):
            pos = gl.minimum(n + j * sub, (kv_len - 1) // sub * sub)
            page = gl.minimum(gl.maximum(gl.load(pages + pos // PAGE), 0), last_page)
            row = page * PAGE + pos % PAGE
            for i in gl.static_range(PIECES):
                dst = smem.index(slot * PIECES + i).slice(j * sub, sub)
                tma_load(desc, [row, kv_col + i * width], bar, dst)


@gluon.jit
def zero_rows_from(smem, slot, valid, PIECES: gl.constexpr, BLOCK_N: gl.constexpr):
    """Rows ``valid ...`` of the tile in ``smem`` slot ``slot`` set to zero, in 8 x 64 chunks (one
    warp: a few registers)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    width: gl.constexpr = smem.shape[2]
    for j in gl.static_range(BLOCK_N // 8):
        if j * 8 + 8 > valid:
            rows = j * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
            keep = gl.expand_dims(rows < valid, 1)
            for i in gl.static_range(PIECES):
                for c in gl.static_range(width // 64):
                    chunk = smem.index(slot * PIECES + i).slice(j * 8, 8).slice(c * 64, 64, dim=1)
                    x = chunk.load(layout)
                    chunk.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def consumer_start(LO, HI, QG, row0, q_row_last, dtype: gl.constexpr, ROWS: gl.constexpr,
                   BLOCK_N: gl.constexpr, WIDTH: gl.constexpr, GROUPS: gl.constexpr):  # fmt: skip
    """A consumer warpgroup's state before its first key tile, for query rows ``row0 ...`` and
    ``WIDTH`` output columns: the rows' intervals and span groups (``gsel``: the row's group, or
    -2 where it has none, never equal to a key's; ``lo`` when ``GROUPS`` is off), the key offsets
    of a tile, the running max and each thread's share of the row sums (``row_parts``), the
    rescale factor, the accumulator, p (zero: the first deferred P @ V adds nothing) and the zero
    scores Q @ K^T starts from. Scores live in wgmma's ``ROWS x BLOCK_N`` accumulator
    layout, the output in its ``ROWS x WIDTH`` one, p as the A operand of P @ V."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 16]
    )
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    # Rows past the sequence end copy the last row's interval (as in kernel.py); an item that
    # stores nothing reads row 0's.
    q_idx = gl.maximum(gl.minimum(row0 + gl.arange(0, ROWS, layout=rows_s), q_row_last), 0)
    lo = gl.load(LO + q_idx)
    hi = gl.load(HI + q_idx)
    gsel = lo
    if GROUPS:
        gq = gl.load(QG + q_idx)
        gsel = gl.where(gq >= 0, gq, -2)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
    l_i = row_parts(gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout))
    alpha = gl.full([ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, o_layout))
    acc = gl.zeros([ROWS, WIDTH], gl.float32, layout=o_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p = gl.zeros([ROWS, BLOCK_N], dtype, layout=p_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    return lo, hi, gsel, offs_n, m_i, l_i, alpha, acc, p, s_zero


@gluon.jit
def last_pv(acc, alpha, p, v_tile, v_ready, last, STAGES: gl.constexpr, live):
    """The last key tile's P @ V, deferred past the loop: ``acc`` rescaled, then ``p @ v_tile``
    once tile ``last``'s values are in (an item without key tiles, not ``live``, waits for
    nothing and stores nothing: its product is never read)."""
    acc = acc * gl.expand_dims(alpha, 1)
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1, pred=live)
    acc = warpgroup_mma(p, v_tile, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc])


@gluon.jit
def q_operand(q, s_zero):
    """The A operand of a key tile's first Q @ K^T MMA (``scores`` with ``SPLIT``) for an item's
    Q tile ``q``: the first half of its columns, loaded into registers once per item. Why: at d512
    (kernel_gluon_split, half of head_dim per consumer) a 32-key tile's bytes through shared
    memory bound it, and an operand in registers is not read from there (S5 4% faster on the
    H200; without it, 7.7% slower again since). kernel_gluon at d256 had gained the same way (S0
    d256 5%, 1/8 of a 64-key tile's 256 KB) until the rescale skipping took registers: since,
    without it S1 / S3 d256 ran 3.7 / 3.5% faster and S0 1.0% slower (4 alternating rounds), so
    there Q stays in shared memory."""
    layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_zero.type.layout, k_width=2)
    return q.slice(0, q.shape[1] // 2, dim=1).load(layout)


@gluon.jit
def scores(q, q_a, k_tile, s_zero, SPLIT: gl.constexpr):
    """Q @ K^T of one key tile, issued asynchronously: one MMA on ``q`` in shared memory, or
    with ``SPLIT`` two, the first half of head_dim from registers (``q_a``: q_operand)."""
    if SPLIT:
        half: gl.constexpr = q.shape[1] // 2
        s = warpgroup_mma(q_a, k_tile.slice(0, half, dim=1).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
        s = warpgroup_mma(q.slice(half, half, dim=1), k_tile.slice(half, half, dim=1).permute((1, 0)), s,
                          is_async=True)  # fmt: skip
    else:
        s = warpgroup_mma(q, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return s


@gluon.jit
def softmax_step(s, m_i, l_i, p, alpha, n, lo, hi, offs_n, full_start, full_end, tma_last, qk_scale,
                 softcap_log2, outside, gsel, KG, ktg, kv_len, own, BLOCK_N: gl.constexpr,
                 SOFTCAP: gl.constexpr, GROUPS: gl.constexpr, CLAMP: gl.constexpr):  # fmt: skip
    """One tile's online-softmax step on raw scores ``s`` of keys ``n ...`` in the log2 domain (as
    kernel._softmax): ``p`` (unnormalized, as the A operand of P @ V: the type and layout of the
    previous ``p``), the factor that rescales what was accumulated before (in ``alpha``'s
    layout, the output's rows), the new reference max and row sums' shares, and with ``own`` (the rows
    that are the item's, not None) the warps' decision whether their maxima moved (gluon_rescale:
    ``alpha`` is 1 where not; not returned without ``own``). Only tiles outside ``[full_start,
    full_end)`` are masked; the last tile, read shifted back to ``tma_last``, is masked by its
    true key indices. With span groups see ``group_mask`` (``outside``: the tile is not in the
    interval walk)."""
    if SOFTCAP:  # c * tanh(score * scale / c), in log2 units (see kernel._softmax)
        s = (1.0 - 2.0 / (gl.exp2(s * (qk_scale * 2.8853900817779268)) + 1.0)) * softcap_log2
        s_scale = 1.0
    else:
        s_scale = qk_scale
    if GROUPS:
        s = group_mask(s, n, lo, hi, offs_n, full_start, full_end, tma_last, outside, gsel, KG, ktg,
                       kv_len, BLOCK_N, CLAMP)  # fmt: skip
    elif (n < full_start) | (n + BLOCK_N > full_end):
        s = gl.where(in_interval(n, lo, hi, offs_n, tma_last), s, float("-inf"))
    m_tile = gl.max(s, 1) * s_scale
    if own is None:
        m_new = gl.maximum(m_i, m_tile)
    else:
        m_new, moved = lazy_max(m_i, m_tile, own)
    # A row may have no allowed key in this tile and none seen yet.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p_f = gl.exp2(s * s_scale - gl.expand_dims(m_use, 1))
    alpha_s = gl.exp2(m_i - m_use)
    alpha_parts = gl.convert_layout(alpha_s, gl.SliceLayout(1, l_i.type.layout))
    l_i = l_i * gl.expand_dims(alpha_parts, 1) + row_parts(p_f)
    p = gl.convert_layout(p_f.to(p.dtype), p.type.layout)
    alpha_s = gl.convert_layout(alpha_s, alpha.type.layout)
    if own is None:
        return p, alpha_s, m_new, l_i
    else:
        return p, alpha_s, m_new, l_i, gl.convert_layout(moved, alpha.type.layout)


@gluon.jit
def group_mask(s, n, lo, hi, offs_n, full_start, full_end, tma_last, outside, gsel, KG, ktg, kv_len,
               BLOCK_N: gl.constexpr, CLAMP: gl.constexpr):  # fmt: skip
    """The mask of groups.py on scores ``s`` of key tile ``n ...``. A FULL tile of the interval
    walk: none. A tile outside it lies past every row's ``hi`` (or, without clamp, before every
    ``lo``), so only groups decide there: with a group code ``ktg`` (group ``g``, its keys all
    but offsets ``[a, b)``), rows of ``g`` see the columns outside ``[a, b)``; else per key, the
    key's group (``KG``: the sequence's key groups) equal to the row's. A partial
    tile of the interval walk: per key, the interval or the group, in clamp mode from ``lo`` on.
    Keys below ``n`` (the shifted last tile) were seen already, keys past the end are none."""
    if outside & (ktg >= 0):
        a = ktg & 255
        b = (ktg >> 8) & 255
        cols = (offs_n < a) | (offs_n >= b)
        rows = gsel == (ktg >> 16)
        s = gl.where(gl.expand_dims(rows, 1) & gl.expand_dims(cols, 0), s, float("-inf"))
    elif outside:
        kv = gl.minimum(n, tma_last) + offs_n
        gk = gl.load(KG + kv, mask=(kv >= n) & (kv < kv_len), other=-1)
        s = gl.where(gl.expand_dims(gk, 0) == gl.expand_dims(gsel, 1), s, float("-inf"))
    elif (n < full_start) | (n + BLOCK_N > full_end):
        kv = gl.minimum(n, tma_last) + offs_n
        gk = gl.load(KG + kv, mask=(kv >= n) & (kv < kv_len), other=-1)
        keep = in_interval(n, lo, hi, offs_n, tma_last)
        same = gl.expand_dims(gk, 0) == gl.expand_dims(gsel, 1)
        if CLAMP:
            same = same & (gl.expand_dims(kv, 0) >= gl.expand_dims(lo, 1))
        s = gl.where(keep | same, s, float("-inf"))
    return s


@gluon.jit
def in_interval(n, lo, hi, offs_n, tma_last):
    """Which scores of key tile ``n ...`` (read from ``min(n, tma_last)``: the shifted last
    tile) fall in their row's keys ``max(lo, n) ... hi`` (keys below ``n`` were seen already):
    one unsigned compare of the key's offset from that first key against the row's count (an
    offset below 0 wraps past every count), so one select a score, where two compares made LLVM
    split the select in two."""
    first = gl.maximum(lo, n)
    since = gl.expand_dims(gl.minimum(n, tma_last) - first, 1) + gl.expand_dims(offs_n, 0)
    count = gl.expand_dims(gl.maximum(hi + 1 - first, 0), 1)
    return since.to(gl.uint32, bitcast=True) < count.to(gl.uint32, bitcast=True)


@gluon.jit
def row_parts(x):
    """Each thread's share of the row sums of ``x`` (an MMA accumulator layout: a thread holds
    column pairs 8 apart), ``[rows, 4]`` over the quad's lanes: summed within threads only."""
    parts = gl.reshape(x, [x.shape[0], x.shape[1] // 8, 4, 2])
    return gl.sum(gl.sum(parts, 3), 1)


@gluon.constexpr_function
def wide_layout(width, adjacent):
    """A consumer's ``64 x width`` output over its 4 warps (16 rows each, as wgmma's), ``adjacent``
    (4 or 8) columns a thread in a lane's registers: wgmma's accumulator layout with lane bits
    (columns 2, 4) traded for register bits (columns 8, 16)."""
    lanes = [[0, 8], [0, 4] if adjacent == 4 else [0, 16], [1, 0], [2, 0], [4, 0]]
    if adjacent == 4:
        regs = [[0, 1], [0, 2], [8, 0], [0, 16]]
    else:
        regs = [[0, 1], [0, 2], [0, 4], [8, 0]]
    regs += [[0, c] for c in (32, 64, 128) if c < width]
    return gl.DistributedLinearLayout(regs, lanes, [[16, 0], [32, 0]], [], [64, width])


@gluon.jit
def store_rows(acc, m_i, l_i, OUT, LSE, row0, q_row_last, head, col0, stride_ot, stride_oh, HQ: gl.constexpr,
               ROWS: gl.constexpr, WRITE_LSE: gl.constexpr, WIDE: gl.constexpr):  # fmt: skip
    """Normalize and store ``acc`` as rows ``row0 ...`` (up to the sequence's last query) and
    columns ``col0 ...`` of the head's output; the rows' LSE (natural log) if asked. ``WIDE``
    (128 or 256 columns): 8 adjacent columns a thread."""
    m_row, l_row = row_stats(acc, m_i, l_i)
    store_out(acc, m_row, l_row, OUT, LSE, row0, q_row_last, None, head, col0, stride_ot, stride_oh, HQ,
              ROWS, WRITE_LSE, WIDE)  # fmt: skip


@gluon.jit
def row_stats(acc, m_i, l_i):
    """The rows' maxima and sums (each thread's shares, row_parts, added up) in ``acc``'s row
    layout, as store_out takes them."""
    rows_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    return gl.convert_layout(m_i, rows_o), gl.convert_layout(gl.sum(l_i, 1), rows_o)


@gluon.jit
def store_out(acc, m_row, l_row, OUT, LSE, row0, q_row_last, keep, head, col0, stride_ot, stride_oh,
              HQ: gl.constexpr, ROWS: gl.constexpr, WRITE_LSE: gl.constexpr, WIDE: gl.constexpr):  # fmt: skip
    """store_rows with the row maxima and sums given per row (in ``acc``'s row layout), and
    ``keep`` (per row, in that layout; None: all) limiting the rows stored."""
    o_layout: gl.constexpr = acc.type.layout
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Every row allows k = q, so l_row > 0 for stored rows.
    acc = acc / gl.expand_dims(l_row, 1)
    out = acc.to(OUT.dtype.element_ty)
    if WIDE:
        # 8 adjacent columns a thread (16-byte stores instead of 4-byte ones, which filled the store
        # queue at the end of every item of a short walk): wgmma's layout (a thread's column pairs
        # 8 apart, lanes 2 and 4 columns apart) with one lane bit swapped for a register bit, then
        # another. triton moves a one-bit swap through warp shuffles; both at once, through shared
        # memory (8 KB at d256, which d128's tiles lack).
        four: gl.constexpr = wide_layout(acc.shape[1], 4)
        eight: gl.constexpr = wide_layout(acc.shape[1], 8)
        out = gl.convert_layout(gl.convert_layout(out, four), eight)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out.type.layout))
    cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, out.type.layout))
    o_rows = gl.expand_dims(rows.to(gl.int64) * stride_ot, 1)
    o_ptrs = OUT + o_rows + head * stride_oh + gl.expand_dims(cols, 0)
    lse_rows = row0 + gl.arange(0, ROWS, layout=rows_o)  # in the row sums' layout
    stored = rows <= q_row_last
    lse_stored = lse_rows <= q_row_last
    if keep is not None:
        # the same rows of the same warps in both layouts (wide_layout only moves columns)
        stored = stored & gl.convert_layout(keep, stored.type.layout)
        lse_stored = lse_stored & keep
    gl.store(o_ptrs, out, mask=gl.expand_dims(stored, 1))
    if WRITE_LSE:
        lse = (m_row + gl.log2(l_row)) * 0.6931471805599453  # ln 2
        gl.store(LSE + lse_rows.to(gl.int64) * HQ + head, lse, mask=lse_stored)
