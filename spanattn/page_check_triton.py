"""page_check.first_bad_entries in ONE Triton launch, for the deferred check of a CUDA block
table: the torch version is ~10 small kernels (host time that a step pays for every table).

One program per sequence walks the columns it reads (``ceil(kv_len / block_size)``) in chunks of
``BLOCK_C`` and keeps the first whose id is outside ``[0, num_blocks)``. Every size is a runtime
scalar exempt from value specialization, so one compiled kernel serves every step and cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backends.triton.direct_launch import DirectLaunch

RUNTIME_ARGS = ["num_blocks", "block_size", "columns", "stride_bt", "stride_bc"]
BLOCK_C = 256  # 16 chunks at most for 64k keys in pages of 16


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _first_bad_kernel(
    BT, SEQ_LENS, OUT, num_blocks, block_size, columns, stride_bt, stride_bc, BLOCK_C: tl.constexpr,
    MERGE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    row = BT + seq.to(tl.int64) * stride_bt
    need = tl.minimum((tl.load(SEQ_LENS + seq) + block_size - 1) // block_size, columns)
    first = columns  # none found yet
    c0 = 0
    while c0 < need:  # a while loop: the interpreter takes no loaded scalar as a range() bound
        cols = c0 + tl.arange(0, BLOCK_C)
        read = cols < need
        ids = tl.load(row + cols.to(tl.int64) * stride_bc, mask=read, other=0)
        bad = read & ((ids < 0) | (ids >= num_blocks))
        first = tl.minimum(first, tl.min(tl.where(bad, cols, columns)))
        c0 += BLOCK_C
    found = first < columns
    value = tl.load(row + first.to(tl.int64) * stride_bc, mask=found, other=0)
    if MERGE:  # a re-check into an earlier result: what that found stays
        tl.store(OUT + 2 * seq, first, mask=found)
        tl.store(OUT + 2 * seq + 1, value, mask=found)
    else:
        tl.store(OUT + 2 * seq, tl.where(found, first, -1))
        tl.store(OUT + 2 * seq + 1, value)


def first_bad_entries_triton(block_table, seq_lens, num_blocks: int, block_size: int, out=None, merge=False):
    """page_check.first_bad_entries of an int32 table, ``seq_lens`` on its device: no sync.
    ``out``: int32 ``[num_seqs, 2]`` to write, on the device or in pinned host memory (which the
    GPU writes through its mapping: no copy back). ``merge``: write only the sequences with a bad
    entry, keeping ``out``'s other rows (an earlier check of the same tensor)."""
    n, columns = block_table.shape
    if out is None:
        out = torch.empty((n, 2), dtype=torch.int32, device=block_table.device)
    # What the compiled kernel depends on besides the grid: the pointers' dtypes and alignment.
    key = (n, merge, block_table.dtype, block_table.data_ptr() % 16, seq_lens.dtype, seq_lens.data_ptr() % 16)
    launch = _launches.get(key)
    if launch is None:
        constants = dict(BLOCK_C=BLOCK_C, MERGE=merge, num_warps=2)
        launch = _launches[key] = DirectLaunch(_first_bad_kernel, (n,), constants)
    launch(block_table, seq_lens, out, num_blocks, block_size, columns, *block_table.stride())
    return out


_launches: dict[tuple, DirectLaunch] = {}  # one per batch size (and alignment) seen
