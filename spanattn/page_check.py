"""The block-table check of :func:`spanattn.attention`: every entry a sequence reads (its first
``ceil(kv_len / block_size)`` columns) names a block of the cache, ``0 <= id < num_blocks``.
Columns past a sequence's keys are never read and may hold anything; shared blocks (prefix
caching) are fine. It runs once per plan and table version, never while a CUDA graph is being
captured, in one of three modes (``check_pages``):

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


def _find_into(block_table, plan: Plan, num_blocks: int, block_size: int, host: torch.Tensor) -> None:
    """``_find`` of a CUDA table into pinned ``host``: the kernel writes it through the GPU's
    mapping of pinned memory (no copy launched), or where the launch refuses host memory, a
    device result copied in behind it."""
    from .page_check_triton import first_bad_entries_triton

    global _mapped
    if _mapped:
        try:
            first_bad_entries_triton(block_table, plan.seq_lens, num_blocks, block_size, out=host)
            return
        except (ValueError, RuntimeError):  # pinned memory without a device mapping
            _mapped = False
    host.copy_(_find(block_table, plan, num_blocks, block_size), non_blocking=True)


_mapped = True  # can kernels write pinned host memory here (unified addressing)?


@dataclass
class _Pending:
    """A deferred check: its result (on the host once ``done`` has completed; ``None``: it
    has), and what its error names. It holds no device tensor, so the table may be freed."""

    result: torch.Tensor
    done: torch.cuda.Event | None
    batch: Batch
    number: int
    num_blocks: int
    buffer: torch.Tensor | None = None  # the pinned memory ``result`` views, reused once read


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
    whose lengths are on the device): once per plan and table version (inference-mode tensors
    have no version: once per plan), first raise what a completed earlier check found, then
    check this table. The layers of a step after its first, passing the same table, pay one
    compare: this runs on every attention call."""
    if how == "off" or plan.capacity is not None:
        return
    version = None if block_table.is_inference() else block_table._version
    last = plan.facts.get("pages_checked_last")  # the table object checked last: one compare
    if last is not None and last[0] is block_table and last[1:] == (version, how, num_blocks):
        return
    if block_table.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # neither a sync nor an event query is allowed while capturing
    key = ("pages_checked", how, block_table.data_ptr(), version, tuple(block_table.shape), num_blocks)

    def first() -> bool:
        if _pending:
            _raise_found(wait=False, where="this call did not run")
        if how == "deferred" and block_table.is_cuda:
            defer(block_table, plan, num_blocks, block_size)
        else:
            check_now(block_table, plan, num_blocks, block_size)
        return True

    plan.cached(key, first)
    plan.facts["pages_checked_last"] = (block_table, version, how, num_blocks)


def check_now(block_table, plan: Plan, num_blocks: int, block_size: int) -> None:
    """Raise IndexError naming the first sequence with a bad entry (on CUDA one host sync)."""
    found = _find(block_table, plan, num_blocks, block_size).tolist()
    for r, (c, value) in enumerate(found):
        if c >= 0:
            raise IndexError(_message(r, c, value, plan.batch, num_blocks))


def defer(block_table, plan: Plan, num_blocks: int, block_size: int) -> None:
    """Start the check of ``block_table`` without waiting for it: its result goes to the host
    behind an event (CPU tensors: at once), and a later :func:`check` or
    :func:`check_pending_pages` raises what it found."""
    if len(_pending) >= MAX_PENDING:
        _raise_found(wait=True, where="this call did not run", limit=1)
    done = buffer = None
    if block_table.is_cuda:
        buffer, done = _buffer_and_event(2 * plan.num_seqs)
        found = buffer[: 2 * plan.num_seqs].view(plan.num_seqs, 2)
        _find_into(block_table, plan, num_blocks, block_size, found)
        done.record(torch.cuda.current_stream(block_table.device))
    else:
        found = _find(block_table, plan, num_blocks, block_size)
    with _lock:
        _pending.append(_Pending(found, done, plan.batch, next(_numbers), num_blocks, buffer))


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
