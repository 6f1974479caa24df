"""Binary search shared by the planning kernels (intervals_triton.py, tiles_triton.py) and the
page copy (backends/triton/page_copy.py)."""

import triton
import triton.language as tl


@triton.jit
def seq_of_rows(cu_q_ptr, rows, num_seqs, steps, BLOCK: tl.constexpr):
    """The sequence of each packed row: the last ``r`` with ``cu_q_ptr[r] <= row`` (cu_seqlens_q or _k).

    ``steps = bit_length(num_seqs)`` suffices: once ``left + 1 == right`` a step is a no-op
    (``mid == left``). A ``while`` loop because the interpreter cannot take runtime ints as
    ``range`` bounds under numpy >= 2.4, and there is nothing here to software-pipeline.
    """
    left = tl.zeros([BLOCK], dtype=tl.int32)
    right = tl.zeros([BLOCK], dtype=tl.int32) + num_seqs
    step = 0
    while step < steps:
        mid = (left + right) // 2
        go_right = tl.load(cu_q_ptr + mid) <= rows
        left = tl.where(go_right, mid, left)
        right = tl.where(go_right, right, mid)
        step += 1
    return left
