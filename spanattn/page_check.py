"""The block-table check of :func:`spanattn.attention`: every entry a sequence reads (its first
``ceil(kv_len / block_size)`` columns) names a block of the cache, ``0 <= id < num_blocks``.
Columns past a sequence's keys are never read and may hold anything; shared blocks (prefix
caching) are fine. It runs once per plan and table, never while a CUDA graph is being captured,
in one of three modes (``check_pages``). A plan knows the last few tables it checked
(``REMEMBERED``) by what proves them unchanged: a CPU table by its entries (a copy compared:
writes through ``.numpy()`` bump no version), a CUDA table by identity and version counter (its
entries could only be compared after a sync; the plan holds the tensor, so no other takes its
memory). Any other table is checked, also one allocated where a checked one was; a CUDA tensor
made under ``torch.inference_mode()`` has no version counter and is checked at every call, its
re-checks merged into its check still pending (one launch and an event record each). A write
that torch does not see (a kernel writing a CUDA table through its raw pointer, DLPack) bumps no
version: pass such a table as a new tensor, or check it with ``"sync"``.

- ``True`` (or ``"deferred"``, the default): a CUDA table is checked by one small launch that
  writes each sequence's first bad entry to pinned host memory, behind a CUDA event: no host
  sync. A later call that checks a new table (any plan: the next step) raises the error of a
  check that has completed by then; :func:`check_pending_pages` waits for them all. A CPU table
  is checked at once (reading it costs no sync).
- ``"sync"``: checked before the call, which raises instead of running (on CUDA a host sync).
- ``False`` (or ``"off"``): not checked, for engines that validate their tables themselves.

Whatever the mode, every kernel and torch path that reads a block table clamps the ids into
``[0, num_blocks)``, so the step that carries a bad table, run before its check is seen, reads
only the cache: the bad sequence's output of that step is wrong, no other sequence's changes.

>>> import torch, spanattn as sa
>>> p = sa.plan(sa.Batch([sa.Seq(1, kv_len=20), sa.Seq(1, kv_len=5)]), sa.LayerMask())
>>> first_bad_entries(torch.tensor([[3, 9], [0, -1]], dtype=torch.int32), p.seq_lens, 8, 16)
tensor([[ 1,  9],
        [-1,  0]], dtype=torch.int32)
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from .plan import Plan
from .spec import Batch

MODES = {True: "deferred", "deferred": "deferred", "sync": "sync", False: "off", "off": "off"}
# Checks waiting for their results; an engine's GPU runs a step or two behind its host, so a
# full list means a stalled consumer: the oldest is then waited for (a sync) before the next.
MAX_PENDING = 16
# Checked tables a plan knows again (most recent first): a step's table, and a few that an
# engine may alternate between; a longer history would only hold more tables alive.
REMEMBERED = 4


def mode(check_pages) -> str:
    """``"deferred"``, ``"sync"`` or ``"off"``: what ``check_pages`` asks for."""
    if isinstance(check_pages, (bool, str)) and check_pages in MODES:
        return MODES[check_pages]
    raise ValueError(
        f"check_pages must be True (or 'deferred': checked on the device, raised by a later call), "
        f"'sync' (checked before the call) or False (or 'off'), got {check_pages!r}"
    )


def first_bad_entries(block_table, seq_lens, num_blocks: int, block_size: int) -> torch.Tensor:
    """int32 ``[num_seqs, 2]``: per sequence the first column it reads whose id is outside
    ``[0, num_blocks)`` and that id, or ``(-1, 0)``. The definition; page_check_triton.py is
    the same in one launch."""
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    need = (seq_lens.to(block_table.device).long() + block_size - 1) // block_size
    bad = (cols < need[:, None]) & ((block_table < 0) | (block_table >= num_blocks))
    col = torch.where(bad.any(1), bad.to(torch.uint8).argmax(1), -1)  # argmax: the first max
    value = torch.where(col >= 0, block_table.gather(1, col.clamp(min=0)[:, None])[:, 0], 0)
    return torch.stack([col, value.long()], 1).int()


def _find(block_table, plan: Plan, num_blocks: int, block_size: int) -> torch.Tensor:
    if block_table.is_cuda:
        from .page_check_triton import first_bad_entries_triton

        return first_bad_entries_triton(block_table, plan.seq_lens, num_blocks, block_size)
    return first_bad_entries(block_table, plan.seq_lens, num_blocks, block_size)


def _launch(block_table, plan: Plan, num_blocks: int, block_size: int, rec: _Pending, merge: bool) -> None:
    """The check of a CUDA table into ``rec.result`` (pinned): the kernel writes it through the
    GPU's mapping of pinned memory (no copy launched), or where the launch refuses host memory,
    into a device buffer copied in behind it. ``merge``: keep what earlier launches found."""
    from .page_check_triton import first_bad_entries_triton

    global _mapped
    args = (block_table, plan.seq_lens, num_blocks, block_size)
    if rec.device is None and _mapped:
        try:
            first_bad_entries_triton(*args, out=rec.result, merge=merge)
            return
        except (ValueError, RuntimeError):  # pinned memory without a device mapping
            _mapped = False
    if rec.device is None:
        rec.device = torch.empty(rec.result.shape, dtype=torch.int32, device=block_table.device)
    first_bad_entries_triton(*args, out=rec.device, merge=merge)
    rec.result.copy_(rec.device, non_blocking=True)


_mapped = True  # can kernels write pinned host memory here (unified addressing)?


@dataclass
class _Pending:
    """A deferred check: its result (on the host once ``done`` has completed; ``None``: it
    has), and what its error names. It holds no device tensor of the caller's, so the table may
    be freed."""

    result: torch.Tensor
    done: torch.cuda.Event | None
    batch: Batch
    number: int
    num_blocks: int
    buffer: torch.Tensor | None = None  # the pinned memory ``result`` views, reused once read
    device: torch.Tensor | None = None  # the kernel's own output where it cannot write ``buffer``
    taken: bool = False  # read (its buffer may serve another check): no re-check merges into it


@dataclass
class _Checked:
    """A table a plan has checked, and how it is known again (module docstring)."""

    how: str
    num_blocks: int
    table: torch.Tensor | None = None  # CUDA: the tensor itself
    version: int | None = None  # CUDA: its version counter (None: an inference tensor has none)
    entries: torch.Tensor | None = None  # CPU: a copy of the table
    pending: _Pending | None = None  # CUDA, deferred: its check

    def holds(self, block_table, how: str, num_blocks: int) -> bool:
        """Is ``block_table`` the table checked here, unchanged, for the same check?"""
        if how != self.how or num_blocks != self.num_blocks:
            return False
        if self.entries is not None:
            return not block_table.is_cuda and torch.equal(self.entries, block_table)
        return (
            self.table is block_table and self.version is not None and self.version == _version(block_table)
        )


def _version(block_table) -> int | None:
    return None if block_table.is_inference() else block_table._version


_lock = threading.Lock()
_pending: list[_Pending] = []
_numbers = itertools.count(1)
# Pinned buffers and events of checks already read, for the next checks: allocating pinned
# memory and creating an event cost host time that every table would pay otherwise.
_free: list[tuple[torch.Tensor, torch.cuda.Event]] = []


def _buffer_and_event(numel: int) -> tuple[torch.Tensor, torch.cuda.Event]:
    with _lock:
        for i, (buf, _) in enumerate(_free):
            if buf.numel() >= numel:
                return _free.pop(i)
    return torch.empty(max(numel, 1024), dtype=torch.int32, pin_memory=True), torch.cuda.Event()


def check(block_table, plan: Plan, num_blocks: int, block_size: int, how: str) -> None:
    """The check of one call (``how`` from :func:`mode`; none for ``"off"`` or a device plan,
    whose lengths are on the device): unless the plan knows this table as checked (module
    docstring), first raise what a completed earlier check found, then check this table. The
    layers of a step after its first, passing the same table, pay one compare (a CPU table: of
    its entries): this runs on every attention call."""
    if how == "off" or plan.capacity is not None:
        return
    seen = plan._facts.get("pages_checked")
    if seen and seen[0].holds(block_table, how, num_blocks):
        return
    if block_table.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # neither a sync nor an event query is allowed while capturing
    if seen is None:
        seen = plan._facts["pages_checked"] = []
    for i, rec in enumerate(seen):
        if rec.holds(block_table, how, num_blocks):
            seen.insert(0, seen.pop(i))
            return
    if _pending:
        _raise_found(wait=False, where="this call did not run")
    rec = _Checked(how, num_blocks)
    if block_table.is_cuda:
        rec.table, rec.version = block_table, _version(block_table)
        if how == "deferred":
            earlier = next((r for r in seen if r.table is block_table and r.pending is not None), None)
            if earlier is not None:  # the same tensor, changed (or without a version): one record
                seen.remove(earlier)
            rec.pending = defer(block_table, plan, num_blocks, block_size, into=earlier and earlier.pending)
    else:
        rec.entries = block_table.clone()
    if rec.pending is None:
        check_now(block_table, plan, num_blocks, block_size)
    seen.insert(0, rec)
    del seen[REMEMBERED:]


def check_now(block_table, plan: Plan, num_blocks: int, block_size: int) -> None:
    """Raise IndexError naming the first sequence with a bad entry (on CUDA one host sync)."""
    found = _find(block_table, plan, num_blocks, block_size).tolist()
    for r, (c, value) in enumerate(found):
        if c >= 0:
            raise IndexError(_message(r, c, value, plan.batch, num_blocks))


def defer(
    block_table, plan: Plan, num_blocks: int, block_size: int, into: _Pending | None = None
) -> _Pending:
    """Start the check of ``block_table`` without waiting for it: its result goes to the host
    behind an event (CPU tensors: at once), and a later :func:`check` or
    :func:`check_pending_pages` raises what it found. ``into``: an unread check of the same CUDA
    tensor, which this one joins (its launch keeps what that found, its event moves behind it)."""
    if block_table.is_cuda:
        with _lock:
            if into is not None and not into.taken:
                _launch(block_table, plan, num_blocks, block_size, into, merge=True)
                into.done.record(torch.cuda.current_stream(block_table.device))
                return into
    if len(_pending) >= MAX_PENDING:
        _raise_found(wait=True, where="this call did not run", limit=1)
    if block_table.is_cuda:
        buffer, done = _buffer_and_event(2 * plan.num_seqs)
        rec = _Pending(
            buffer[: 2 * plan.num_seqs].view(plan.num_seqs, 2), done, plan.batch, 0, num_blocks, buffer
        )
        _launch(block_table, plan, num_blocks, block_size, rec, merge=False)
        done.record(torch.cuda.current_stream(block_table.device))
    else:
        rec = _Pending(_find(block_table, plan, num_blocks, block_size), None, plan.batch, 0, num_blocks)
    with _lock:
        rec.number = next(_numbers)
        _pending.append(rec)
    return rec


def check_pending_pages() -> None:
    """Wait for every deferred block-table check (``check_pages=True`` on CUDA) and raise
    IndexError for the first that found a block id outside the cache, naming the step, the
    sequence, the entry and its value. For an engine's end of step, or tests; without it the
    next call that checks pages raises once the check has completed.

    >>> import spanattn as sa
    >>> sa.check_pending_pages()  # nothing pending: returns None
    """
    _raise_found(wait=True, where="raised by check_pending_pages")


def _raise_found(wait: bool, where: str, limit: int | None = None) -> None:
    """Take the pending checks in order (``wait``: all, or the ``limit`` oldest, after waiting for
    them; else up to the first not completed) until one that found a bad entry: raise its error."""
    hit = None
    with _lock:
        for rec in list(_pending)[:limit]:
            if rec.done is not None:
                if wait:
                    rec.done.synchronize()
                elif not rec.done.query():
                    break  # later ones are most likely behind it on the stream: one query per call
            _pending.remove(rec)
            rec.taken = True
            columns = rec.result[:, 0].numpy()  # numpy: a torch op on a small host tensor costs ~10 us
            if columns.max(initial=-1) >= 0:
                hit = rec, int((columns >= 0).argmax())
                break
            if rec.buffer is not None:
                _free.append((rec.buffer, rec.done))
    if hit is None:
        return
    rec, r = hit
    c, value = rec.result[r].tolist()
    raise IndexError(
        _message(r, c, value, rec.batch, rec.num_blocks)
        + f", found by the deferred check of an EARLIER call's table (page check #{rec.number}, "
        f"a step of {len(rec.batch)} sequences: {_describe(rec.batch)}). That step ran with the id "
        f"clamped into the cache: sequence {r}'s output of it is wrong, no other sequence's; {where}. "
        "check_pages='sync' raises before the call instead"
    )


def _message(r: int, c: int, value: int, batch: Batch, num_blocks: int) -> str:
    return (
        f"block_table[{r}, {c}] = {value}: sequence {r} (kv_len {batch.seqs[r].kv_len}) reads that "
        f"block, but block ids must be in [0, num_blocks={num_blocks})"
    )


def _describe(batch: Batch) -> str:
    kv = [s.kv_len for s in batch.seqs]
    return f"{batch.total_q} queries, kv_len {min(kv)}..{max(kv)}"
