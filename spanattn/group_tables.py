"""The host-known tables of a step's span groups, built in Python for step_tensors' one copy.

Which key rows each group holds depends on the step's description alone (``Batch.span_rows``
and the sequences' lengths), so it is written down here, before the copy, rather than found on
the device: there it took a ``nonzero`` (a host sync), an argsort and a scatter per table.

>>> import spanattn as sa
>>> b = sa.Batch([sa.Seq(4), sa.Seq(q_len=9, spans=[(1, 2, 0), (5, 6, 0), (7, 8, 1)])])
>>> group_tables(b.span_rows, [0, 4, 13], [4, 9])
([(0, 5, 6), (0, 9, 10)], [(5, 10)])
"""

from __future__ import annotations


def group_tables(span_rows, cu_k, kv_len) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """``(spans, extents)`` of ``SpanGroups``: rows ``(group, first key row, last key row)`` of
    every grouped span in packed key rows, ordered by group then start, ends capped at the
    sequence's last key; and each group's ``(first, last)`` key row, ids ``0..num_groups - 1``.

    span_rows: ``Batch.span_rows`` (seq, start, end, group id or -1); cu_k, kv_len: ints, the
    step's ``cu_seqlens_k`` and each sequence's keys. A group's spans lie in one sequence,
    disjoint, so starts never tie.
    """
    spans = sorted((g, cu_k[i] + a, cu_k[i] + min(b, kv_len[i] - 1)) for i, a, b, g in span_rows if g >= 0)
    extents: dict[int, tuple[int, int]] = {}
    for g, s, e in spans:
        first, last = extents.get(g, (s, e))
        extents[g] = (first, max(last, e))
    return spans, [extents[g] for g in range(len(extents))]
