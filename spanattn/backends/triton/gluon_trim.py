"""Each consumer warpgroup walks only the key tiles its own 64 query rows need (Hopper).

A work item's walk covers every key any of its 128 query rows sees, but the two consumers' rows
lie 64 apart: at a sliding window's lower edge the second consumer's first tile, and at the
diagonal the first consumer's last tile, can hold no key of theirs (64-key tiles at d256: S1 /
S3 4.0 / 4.7% of the consumers' key tiles, S1 d128 0.9%, long causal walks 0-0.2%:
benchmarks/walk_waste.py). With ``Config.trim`` (the default walks whole) a consumer computes
Q @ K^T, softmax and P @ V only on the tiles from the first holding its rows' smallest ``lo``
to the last holding their largest ``hi``; the others it releases unread. What it skips it
would have masked whole (p = 0 for each of its rows), so its rows' maxima, sums and output are
the same bits.

The ring's ``done`` barriers (gluon_parts.ring_barriers) take one arrival per consumer per tile,
in the walk's order. A skipped tile's arrival waits for the tile's keys to be in: the producer
loads them only once both consumers released the slot's previous tile, so an arrival never
counts toward the slot's earlier phase (which the other consumer may still be reading). Span
group walks (tiles outside the interval walk) are never trimmed.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def own_walk(lo, hi, kv_start, num_tiles, BLOCK_N: gl.constexpr, TRIM: gl.constexpr):
    """``(first, end)``: with ``TRIM`` the walk tiles ``first ... end - 1`` hold every key of the
    rows whose intervals are ``lo`` / ``hi`` (tile ``t`` starts at key ``kv_start + t *
    BLOCK_N``), at least one, as an item without key tiles runs one predicated off; without,
    the whole walk."""
    first = num_tiles * 0
    end = num_tiles
    if TRIM:
        first = gl.maximum(gl.minimum((gl.min(lo, 0) - kv_start) // BLOCK_N, num_tiles - 1), 0)
        end = gl.maximum(gl.minimum((gl.max(hi, 0) - kv_start) // BLOCK_N + 1, num_tiles), first + 1)
    return first, end


@gluon.jit
def release_unread(k_ready, done, c, start, end, STAGES: gl.constexpr):
    """Release the walk tiles ``start ... end - 1`` of the item whose walk begins at the program's
    key tile ``c``, once each one's keys are in (the module docstring says why)::

        release_unread(k_ready, done, c, 0, first, STAGES)
    """
    for t in range(start, end):
        slot = (c + t) % STAGES
        mbarrier.wait(k_ready.index(slot), ((c + t) // STAGES) & 1)
        mbarrier.arrive(done.index(slot))
