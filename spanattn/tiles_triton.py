"""The tile tables of tiles.py in ONE Triton launch (CUDA), packed intervals included.

Planning is launch-bound on a GPU: the torch version is ~40 small kernels (~0.7 ms on an H200
for a 32k step), this is one. Same definitions and conventions as ``tiles.build_tile_tables``
(tests hold them equal, under ``TRITON_INTERPRET=1`` without a GPU). One program per query
block; KV blocks are visited CHUNK at a time as a ``[BLOCK_M, CHUNK]`` tile of row/block tests:

- touched: some row's ``[alo, ahi]`` meets the block; covered: every row's contains it (rows
  past ``total_q`` carry an empty interval, so a short query block is never FULL, and a short
  last KV block is never covered because ``ahi < total_k``);
- pass 1 counts PARTIAL and FULL blocks, pass 2 writes each block index at its place: listed
  blocks first, then the others, both ascending (create_block_mask's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_search import seq_of_rows

# every scalar whose value changes from step to step (triton would specialize on = 1 and % 16)
RUNTIME_ARGS = ["num_seqs", "total_q", "num_kv_blocks", "search_steps"]


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _tile_tables_kernel(
    lo_ptr, hi_ptr, cu_q_ptr, cu_k_ptr, num_seqs, total_q, num_kv_blocks, search_steps,
    alo_ptr, ahi_ptr, kv_num_ptr, kv_idx_ptr, full_num_ptr, full_idx_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < total_q
    seq = seq_of_rows(cu_q_ptr, rows, num_seqs, search_steps, BLOCK_M)
    offset = tl.load(cu_k_ptr + seq, mask=valid, other=0)
    alo = tl.load(lo_ptr + rows, mask=valid, other=0) + offset
    ahi = tl.load(hi_ptr + rows, mask=valid, other=0) + offset
    tl.store(alo_ptr + rows, alo, mask=valid)
    tl.store(ahi_ptr + rows, ahi, mask=valid)
    alo = tl.where(valid, alo, 2147483647)[:, None]  # empty interval: touches and covers nothing
    ahi = tl.where(valid, ahi, -1)[:, None]

    total_p = 0
    total_f = 0
    c = 0
    # ``while``: the interpreter cannot take runtime ints as ``range`` bounds (numpy >= 2.4)
    while c < num_kv_blocks:
        n = c + tl.arange(0, CHUNK)
        start = (n * BLOCK_N)[None, :]
        end = start + BLOCK_N - 1
        touched = tl.sum(((alo <= end) & (ahi >= start)).to(tl.int32), axis=0) > 0
        full = tl.sum(((alo <= start) & (ahi >= end)).to(tl.int32), axis=0) == BLOCK_M
        partial = touched & (full == 0) & (n < num_kv_blocks)
        total_p += tl.sum(partial.to(tl.int32))
        total_f += tl.sum((full & (n < num_kv_blocks)).to(tl.int32))
        c += CHUNK
    tl.store(kv_num_ptr + m, total_p)
    tl.store(full_num_ptr + m, total_f)

    seen_p = 0
    seen_f = 0
    row_base = m.to(tl.int64) * num_kv_blocks
    c = 0
    while c < num_kv_blocks:
        n = c + tl.arange(0, CHUNK)
        inside = n < num_kv_blocks
        start = (n * BLOCK_N)[None, :]
        end = start + BLOCK_N - 1
        touched = tl.sum(((alo <= end) & (ahi >= start)).to(tl.int32), axis=0) > 0
        full = (tl.sum(((alo <= start) & (ahi >= end)).to(tl.int32), axis=0) == BLOCK_M) & inside
        partial = (touched & (full == 0) & inside).to(tl.int32)
        full = full.to(tl.int32)
        # listed block: its rank among listed ones; other block: after all listed, by rank
        before_p = tl.cumsum(partial, axis=0) - partial + seen_p
        before_f = tl.cumsum(full, axis=0) - full + seen_f
        pos_p = tl.where(partial > 0, before_p, total_p + n - before_p)
        pos_f = tl.where(full > 0, before_f, total_f + n - before_f)
        tl.store(kv_idx_ptr + row_base + pos_p, n, mask=inside)
        tl.store(full_idx_ptr + row_base + pos_f, n, mask=inside)
        seen_p += tl.sum(partial)
        seen_f += tl.sum(full)
        c += CHUNK


def fused_tile_tables(plan, BLOCK_M: int = 128, BLOCK_N: int = 128, CHUNK: int = 64):
    """``(alo, ahi)`` and the tables' four tensors for ``plan``, from one launch."""
    total_q, num_seqs = plan.total_q, plan.num_seqs
    num_q_blocks = -(-total_q // BLOCK_M)
    num_kv_blocks = -(-plan.total_k // BLOCK_N)
    dev = plan.device
    alo = torch.empty(total_q, dtype=torch.int32, device=dev)
    ahi = torch.empty(total_q, dtype=torch.int32, device=dev)
    nums = torch.empty(2, num_q_blocks, dtype=torch.int32, device=dev)
    idx = torch.empty(2, num_q_blocks, num_kv_blocks, dtype=torch.int32, device=dev)
    _tile_tables_kernel[(num_q_blocks,)](
        plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k, num_seqs, total_q, num_kv_blocks,
        max(1, num_seqs.bit_length()), alo, ahi, nums[0], idx[0], nums[1], idx[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNK=CHUNK,
    )  # fmt: skip
    return (alo, ahi), (nums[0], idx[0], nums[1], idx[1])
