"""A paged prefill step's keys and values copied out of the cache into packed K/V, both in ONE
launch. The torch version (slots from ~6 small ops, then two ``index_select``) took 0.107 ms on
an H200 for 32k keys x 8 KV heads x d128 bf16, against 0.063 ms to read and write K and V once;
this kernel 0.073 ms (3.65-3.85 TB/s, within 5% over 16-64 KB per program and 4 or 8 warps).

Each program moves a ``[ROWS, BLOCK_W]`` tile of packed rows: each row's sequence by binary
search over ``cu_seqlens_k``, its slot from ``block_table``, then the row's ``Hkv * D`` elements
(2 KB at 8 heads x d128 bf16; contiguous in the source when heads are) as one vector per row.
Lengths are runtime scalars exempt from value specialization, and so is the table's stride (its
width may change between steps): no step recompiles it, synchronizes or allocates, so it can be
captured in a CUDA graph. Only the dtype, head layout and page size pick a compiled kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...triton_search import seq_of_rows
from .configs import next_pow2

# every argument whose value changes from step to step, and the caller's block table (a view at
# any offset; the plan's own tensors always start on 16 bytes)
RUNTIME_ARGS = ["block_table_ptr", "total_k", "num_seqs", "search_steps", "stride_bt", "last_page"]
# 32 KB of K and 32 KB of V per program (16 rows x 1024 elements at bf16): ~2k programs on a 32k
# step, and at 8 warps 128 B of each per thread, 8 x 16 B loads in flight to cover HBM latency
# (16 and 64 KB, 4 warps: the same within 5% on the H200).
TILE_BYTES = 32 * 1024
MAX_BLOCK_W = 1024  # wider rows (more heads x head_dim) take several programs along axis 1
NUM_WARPS = 8


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _copy_pages_kernel(
    K, V, OUT_K, OUT_V, cu_k_ptr, block_table_ptr,
    total_k, num_seqs, search_steps, stride_bt, last_page, stride_kt, stride_kh, stride_vt, stride_vh,
    D: tl.constexpr, WIDTH: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = rows < total_k
    seq = seq_of_rows(cu_k_ptr, rows, num_seqs, search_steps, ROWS)
    pos = rows - tl.load(cu_k_ptr + seq)
    # rows past total_k land past the last sequence's table columns: their loads stay masked
    page = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)
    # clamped into the cache: a table read before its check raises (page_check.py) stays inside it
    page = tl.minimum(tl.maximum(page, 0), last_page)
    slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # int64: caches exceed 2^31 elements
    col = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    # head and offset within it: runs of D contiguous elements whatever the head stride, enough
    # for 16-byte vectors; WIDTH is a multiple of 16, so the column mask does not split them
    head, d = col // D, col % D
    mask = valid[:, None] & (col < WIDTH)[None, :]
    dst = rows.to(tl.int64)[:, None] * WIDTH + col[None, :]
    src_k = slot[:, None] * stride_kt + (head * stride_kh + d)[None, :]
    src_v = slot[:, None] * stride_vt + (head * stride_vh + d)[None, :]
    tl.store(OUT_K + dst, tl.load(K + src_k, mask=mask), mask=mask)
    tl.store(OUT_V + dst, tl.load(V + src_v, mask=mask), mask=mask)


def copy_pages(plan, k, v, block_table, page_size: int, out_k, out_v) -> None:
    """Fill ``out_k, out_v [plan.total_k, Hkv, D]`` (contiguous) with the step's keys and values
    in packed order, from ``k, v [num_blocks * page_size, Hkv, D]`` (last dim contiguous): key
    ``pos`` of sequence ``s`` at slot ``block_table[s, pos // page_size] * page_size + pos %
    page_size``."""
    total, hkv, d = out_k.shape
    if total == 0:
        return
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    width = hkv * d
    block_w = min(next_pow2(width), MAX_BLOCK_W)
    rows = TILE_BYTES // (block_w * k.element_size())
    n = plan.num_seqs
    grid = (-(-total // rows), -(-width // block_w))
    _copy_pages_kernel[grid](
        k, v, out_k, out_v, plan.cu_seqlens_k, block_table, total, n, n.bit_length(),
        block_table.stride(0), k.shape[0] // page_size - 1, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), D=d, WIDTH=width, PAGE_SIZE=page_size, ROWS=rows, BLOCK_W=block_w,
        num_warps=NUM_WARPS,
    )  # fmt: skip
