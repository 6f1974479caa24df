"""Work items dealt at run time to the programs of a persistent Gluon launch (Hopper), in an
order whose programs at work together read the same K/V.

An item is (query tile, head). The schedule lists tiles heaviest first; items run in sections
of ``section`` KV heads (all their query heads): a section's items, its tiles heaviest first and
the section's heads fastest, then the next section's. Sized so that a section's K and V fit in
L2, the programs running at once mostly read keys another has just brought in (one 32k-token
sequence at d128 holds 16 MB of K/V per KV head: all eight heads at once, 128 MB, do not fit
the H200's 50 MB). A fixed deal of such an order cannot even out (each section restarts at its
heaviest tiles: the busiest program 1.10-1.24x a perfect split on S0, simulated), so
each program's producer warp takes the next item from a counter in global memory once it has
issued the current item's last loads, as the hardware deals one program per item, and hands it
to the consumers through shared memory. The consumers still have a few tiles to go then, so the
atomic's latency hides under them; taken when an item starts, a program would hold its next
item for a whole item's time and the last items would wait on busy programs while others idle
(S0 d256 1.3% slower on the H200: results/2026-12-02-ab-trees-run-time-deal-late-h200.json).
Which program computes an item changes from run to run; an item's rows are computed by one
program alone in a fixed order (a halved item's by two, merged in a fixed order), so outputs
stay bit-identical.

The counter: two int32 in global memory, zero between launches (the next item past the first
round's, and how many programs have ended); the last program to end sets both back to zero,
so the next launch (stream order) finds them zero without a memset, also in a CUDA graph. Two
launches at once must not share one: ``GluonLaunch`` keeps one per stream. The last items of
the order may be dealt as two halves each (gluon_halves.py): the deal counts units then.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.runtime import driver

from .gluon_compat import partition_barrier

# One lane of the calling warp adds 1 to the int32 at the address; every lane gets the value it
# held before (shuffled from that lane). _ADD_ACQ_REL: the same, ordered after the lane's
# earlier atomics (acquire-release, GPU scope).
_ADD = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.b32 $0, 0; "
    "@p atom.global.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 31, -1; }"
)
_ADD_ACQ_REL = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; mov.b32 $0, 0; "
    "@p atom.global.acq_rel.gpu.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 31, -1; }"
)
# Both counters back to zero (one lane).
_RESET = gl.constexpr(
    "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
    "@p st.global.v2.u32 [$1], {0, 0}; mov.b32 $0, 0; }"
)


@gluon.jit
def deal_ring():
    """The shared memory through which the producer hands items to the consumers: two item
    slots, each with a ``full`` barrier (the producer's arrival) and a ``free`` one (one arrival
    per consumer warpgroup)."""
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    return items, full, free


@gluon.jit
def next_item(DEAL):
    """Producer: the next item (``DEAL``: the launch's counters), past the first round's (one per
    program)."""
    taken = gl.inline_asm_elementwise(_ADD, "=r,l", [DEAL], dtype=gl.int32, is_pure=False, pack=1)
    return gl.num_programs(0) + taken


@gluon.jit
def publish(items, full, free, item, r):
    """Producer: item ``item`` is this program's ``r``-th (an item past the last one ends the
    consumers' loops), once the consumers have read round ``r - 2``'s from the same slot."""
    slot = r % 2
    mbarrier.wait(free.index(slot), ((r // 2) - 1) & 1, pred=r >= 2)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])  # every thread holds it
    items.index(slot).store(gl.full([1], item, gl.int32, one))
    partition_barrier()
    mbarrier.arrive(full.index(slot))


@gluon.jit
def take(items, full, free, r):
    """Consumer: this program's ``r``-th item, the slot handed back."""
    slot = r % 2
    mbarrier.wait(full.index(slot), (r // 2) & 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    item = gl.max(items.index(slot).load(one), 0)
    partition_barrier()
    mbarrier.arrive(free.index(slot))
    return item


@gluon.jit
def finish(DEAL):
    """Producer, after its last item: count this program's end; the last program's resets the
    counters for the next launch (every other program has taken its last item by then: its end
    is counted after, in acquire-release order)."""
    ended = gl.inline_asm_elementwise(_ADD_ACQ_REL, "=r,l", [DEAL + 1], dtype=gl.int32, is_pure=False, pack=1)
    if ended == gl.num_programs(0) - 1:
        gl.inline_asm_elementwise(_RESET, "=r,l", [DEAL], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def item_place(item, num_items, section, HQ: gl.constexpr, GROUP: gl.constexpr):
    """Item ``item``'s query tile (its row of the schedule) and head: sections of ``section`` KV
    heads, each its tiles heaviest first, the section's ``section * GROUP`` heads fastest."""
    heads = section * GROUP
    per_section = (num_items // HQ) * heads
    s = item // per_section
    within = item - s * per_section
    return within // heads, s * heads + within % heads


def kv_head_bytes(keys: int, head_dim: int, element_size: int) -> int:
    """The K and V of one KV head over a step's ``keys``."""
    return keys * 2 * head_dim * element_size


def kv_heads_per_section(hkv: int, kv_bytes_per_head: int, l2_bytes: int) -> int:
    """The most KV heads (a divisor of ``hkv``) whose K and V fit in ``l2_bytes`` together; one
    if a head's alone does not.

    >>> kv_heads_per_section(8, 16 << 20, 50 << 20)
    2
    """
    fits = [s for s in range(1, hkv + 1) if hkv % s == 0 and s * kv_bytes_per_head <= l2_bytes]
    return max(fits, default=1)


@functools.cache  # a device property query costs microseconds of host time per call
def l2_bytes(device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


class PerStream:
    """A tensor per stream (``make()`` on a stream's first launch): launches on one stream run
    one after another and may share it; a launch on another stream gets its own."""

    def __init__(self, device: torch.device, make):
        self.device, self.make = device, make
        self.by_stream: dict[int, torch.Tensor] = {}

    def __call__(self) -> torch.Tensor:
        # The stream the launch goes to (as direct_launch.py finds it); none on the CPU, where
        # the launches are only recorded (tests).
        stream = (
            driver.active.get_current_stream(driver.active.get_current_device())
            if self.device.type == "cuda"
            else 0
        )
        kept = self.by_stream.get(stream)
        if kept is None:
            kept = self.by_stream[stream] = self.make()
        return kept


class Counters(PerStream):
    """A launch's two int32 counters for the current stream, then ``flags`` more (gluon_halves:
    its halved items' warps), all zero between launches."""

    def __init__(self, device: torch.device, flags: int = 0):
        super().__init__(device, lambda: torch.zeros(2 + flags, dtype=torch.int32, device=device))
