"""Binary searches shared by the planning kernels (intervals_triton.py, groups_triton.py,
tiles_triton.py) and the page copy (backends/triton/page_copy.py)."""

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


@triton.jit
def span_at(spans_ptr, seq, pos, num_spans, steps, BLOCK: tl.constexpr):
    """The row of step_tensors' ``spans`` (``[num_spans, 3]``: seq, start, end, ordered by seq
    then start) that may hold each ``(seq, pos)``: the last one starting at or before it, -1
    where none does. The caller tests ``spans[j, 0] == seq and pos <= spans[j, 2]``.

    The count of spans at or before ``(seq, pos)`` narrows the half-open ``[a, b)`` to itself;
    ``steps = bit_length(num_spans)`` suffices, and once ``a == b`` the loads are masked off.
    """
    a = tl.zeros([BLOCK], dtype=tl.int32)
    b = tl.zeros([BLOCK], dtype=tl.int32) + num_spans
    step = 0
    while step < steps:
        mid = (a + b) // 2
        open_ = a < b
        s_seq = tl.load(spans_ptr + mid * 3, mask=open_, other=0)
        s_start = tl.load(spans_ptr + mid * 3 + 1, mask=open_, other=0)
        before = (s_seq < seq) | ((s_seq == seq) & (s_start <= pos))
        a = tl.where(open_ & before, mid + 1, a)
        b = tl.where(open_ & ~before, mid, b)
        step += 1
    return a - 1
