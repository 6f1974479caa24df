"""FA4's compiled kernel called directly on a plan's later calls, without its Python interface.

FA4's public functions spend most of a call's host time (about 0.3 ms on an H200) normalizing
arguments, deriving tile shapes and block-sparse views and building a compile key, all of which
depend only on shapes, dtypes and tensors that a plan keeps for its whole life; then they call
``_flash_attn_fwd.compile_cache[key](*args)``, a compiled function taking torch tensors (the
stream comes from torch). So the first call for a plan and call shape runs the public function
with that cache wrapped for the one call, recording the compiled function and its arguments;
the arguments that are this call's tensors (q, k, v and the out/lse FA4 allocated) are found by
address, shape, strides and dtype, the rest are kept. Later calls allocate out (and lse) as FA4
did and call the compiled function with their own tensors in those places.

Anything that does not fit that picture leaves the call shape on the public function for the
life of the plan (one debug log line says why): no compiled call or more than one, a call
tensor FA4 copied or passed inside another argument, an argument of a type not understood, an
exception. Each compile key's first direct call is checked bit for bit against the public
function on the same tensors (once per process), before the key is trusted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

NAMES = ("q", "k", "v", "out", "lse")
# A later call's q, k, v must be aligned as the recorded ones were, up to 64 bytes (as every CPU
# or CUDA allocation is): FA4 copies an input whose address its kernel cannot load from (16-byte
# alignment in 4.0.0b36), so a recorded call vouches only for the alignment it saw.
MAX_ALIGN = 64
_recording = threading.Lock()  # one recording at a time: each swaps the cache and puts it back
_verified: dict = {}  # compile key -> did its first direct call give the public function's bits?
PUBLIC = "public"  # a record that says: this call shape takes the public function


@dataclass
class Record:
    """One call shape's compiled function and its arguments, ``None`` where a call's own
    tensor goes (``slots``: argument index -> index into ``NAMES``)."""

    key: object
    fn: object
    args: list
    slots: tuple
    out: tuple  # shape, strides, dtype, device of the output FA4 allocated
    lse: tuple | None
    align: int
    trusted: bool = False  # its compile key's check passed (read once, not hashed per call)


class _Recorder:
    """Stands in for the compile cache during one call: forwards everything to it and wraps
    what it hands out, noting the calls made from the recording thread."""

    def __init__(self, cache):
        self.cache, self.calls, self.thread = cache, [], threading.get_ident()

    def __contains__(self, key):
        return key in self.cache

    def __setitem__(self, key, fn):
        self.cache[key] = fn

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def __getitem__(self, key):
        fn = self.cache[key]

        def call(*args, **kwargs):
            if threading.get_ident() == self.thread:
                self.calls.append((key, fn, args, kwargs))
            return fn(*args, **kwargs)

        return call


class DirectCall:
    """FA4's public ``fn`` with fixed keyword arguments, called on ``(q, k, v)``; ``host`` is
    the object whose ``compile_cache`` the public function calls through (FA4's
    ``interface._flash_attn_fwd``; None where it is missing: then always the public function).
    Records live on this object: cache it on the plan whose tensors the fixed arguments are::

        call = plan.cached(key, lambda: DirectCall(flash_attn_varlen_func, host, causal=True, ...))
        out, lse = call(q, k, v, scale, softcap, return_lse)

    A ``fn`` that writes into a given output takes ``out=`` and ``lse=`` (fa4_flags.py): a call
    passing them gets them back written, on the public function and directly alike.
    """

    def __init__(self, fn, host, **fixed):
        self.fn, self.host, self.fixed, self.records = fn, host, fixed, {}

    def public(self, q, k, v, scale, softcap, return_lse, out=None, lse=None):
        given = {} if out is None else {"out": out, "lse": lse}
        kw = dict(softmax_scale=scale, softcap=softcap, return_lse=return_lse)
        return self.fn(q, k, v, **kw, **given, **self.fixed)

    def __call__(self, q, k, v, scale, softcap, return_lse, out=None, lse=None):
        key = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
               q.device, scale, softcap, return_lse, _spec(out), _spec(lse))  # fmt: skip
        given = (out, lse)
        rec = self.records.get(key)
        if rec is PUBLIC or q.requires_grad or k.requires_grad or v.requires_grad:
            return self.public(q, k, v, scale, softcap, return_lse, *given)  # autograd needs FA4's Function
        if rec is None:
            return self._record(key, q, k, v, scale, softcap, return_lse, given)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & (rec.align - 1):
            return self.public(q, k, v, scale, softcap, return_lse, *given)  # FA4 would copy them
        if not rec.trusted:
            checked = _verified.get(rec.key)
            if checked is None:
                return self._verify(key, rec, q, k, v, scale, softcap, return_lse, given)
            if not checked:
                self._give_up(key, "its compiled function failed the check for another plan")
                return self.public(q, k, v, scale, softcap, return_lse, *given)
            rec.trusted = True
        return direct(rec, q, k, v, *given)

    def _give_up(self, key, why: str) -> None:
        log.debug("fa4: FA4's public function for this plan's %s calls: %s", _shape(key), why)
        self.records[key] = PUBLIC

    def _record(self, key, q, k, v, scale, softcap, return_lse, given):
        if _aliased(q, k, v):  # which argument is which would be a guess: record another call
            return self.public(q, k, v, scale, softcap, return_lse, *given)
        cache = getattr(self.host, "compile_cache", None)
        if cache is None:
            self._give_up(key, "no compile_cache to record the compiled call from")
            return self.public(q, k, v, scale, softcap, return_lse, *given)
        with _recording:
            recorder = _Recorder(cache)
            self.host.compile_cache = recorder
            try:
                out, lse = self.public(q, k, v, scale, softcap, return_lse, *given)
            finally:
                self.host.compile_cache = cache
        try:
            rec = record(recorder.calls, (q, k, v, out, lse))
        except Exception as e:  # whatever FA4 did that this does not understand
            rec = f"{type(e).__name__}: {e}"
        if isinstance(rec, str):
            self._give_up(key, rec)
        else:
            self.records[key] = rec
        return out, lse

    def _verify(self, key, rec, q, k, v, scale, softcap, return_lse, given):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return self.public(q, k, v, scale, softcap, return_lse, *given)  # comparing would sync
        # a given output holds other launches' rows too: both sides write into zeroed copies
        scratch = lambda: tuple(None if t is None else torch.zeros_like(t) for t in given)
        try:
            got = direct(rec, q, k, v, *scratch())
        except Exception as e:
            got = e
        want = self.public(q, k, v, scale, softcap, return_lse, *scratch())
        ok = not isinstance(got, Exception) and all(map(same_bits, got, want))
        _verified[rec.key] = ok
        if not ok:
            why = f"raised {type(got).__name__}: {got}" if isinstance(got, Exception) else "gave other bits"
            self._give_up(key, f"its first direct call {why} (checked against the public function)")
            return want if given[0] is None else self.public(q, k, v, scale, softcap, return_lse, *given)
        rec.trusted = True
        return got if given[0] is None else direct(rec, q, k, v, *given)


def direct(rec: Record, q, k, v, out=None, lse=None):
    """The recorded compiled function on this call's tensors, out and lse allocated as FA4 did
    unless given (then of the recorded shape: the call's key holds it)."""
    if out is None:
        out = _empty(*rec.out)
        lse = None if rec.lse is None else _empty(*rec.lse)
    tensors = (q, k, v, out, lse)
    args = rec.args.copy()
    for i, j in rec.slots:
        args[i] = tensors[j]
    rec.fn(*args)
    return out, lse


def record(calls: list, tensors: tuple) -> Record | str:
    """The Record of a recorded call on ``tensors = (q, k, v, out, lse)`` (lse None when FA4
    returned none), or why there is none."""
    if len(calls) != 1:
        return f"{len(calls)} compiled calls in one public call, not 1"
    key, fn, args, kwargs = calls[0]
    if kwargs:
        return f"the compiled function took keyword arguments {sorted(kwargs)}"
    mine = {_signature(t): j for j, t in enumerate(tensors) if t is not None}
    if len(mine) < sum(t is not None for t in tensors):
        return "two of q, k, v, out, lse are the same tensor"
    storages = {_storage(t): NAMES[j] for j, t in enumerate(tensors) if t is not None and _storage(t)}
    args, slots = list(args), []
    for i, a in enumerate(args):
        j = mine.get(_signature(a)) if isinstance(a, torch.Tensor) else None
        if j is not None:
            slots.append((i, j))
            args[i] = None  # the call's own tensor is not kept
            continue
        why = _constant(a, storages)
        if why:
            return f"argument {i}: {why}"
    missing = set(mine.values()) - {j for _, j in slots}
    if missing:
        return f"{', '.join(NAMES[j] for j in sorted(missing))} not passed as such (copied?)"
    align = MAX_ALIGN
    for t in tensors[:3]:
        while t.data_ptr() % align:
            align //= 2
    hash(key)  # a key that cannot be one raises here, before it is trusted
    return Record(key, fn, args, tuple(slots), _spec(tensors[3]), _spec(tensors[4]), align)


def _constant(a, storages: dict, depth: int = 0) -> str | None:
    """Why argument ``a`` cannot be kept for later calls (None: it can): it is or holds a view
    of a call's tensor, or something whose contents cannot be seen."""
    if a is None or isinstance(a, (bool, int, float, str)):
        return None
    if isinstance(a, torch.Tensor):
        hit = storages.get(_storage(a))
        return None if hit is None else f"a view of {hit} (or {hit} inside another argument)"
    if isinstance(a, (tuple, list)) and depth < 4:  # FA4's tuples of block-sparse and aux tensors
        return next(filter(None, (_constant(x, storages, depth + 1) for x in a)), None)
    return f"a {type(a).__name__}, not understood"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _spec(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _empty(shape, stride, dtype, device) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _signature(t: torch.Tensor):
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _aliased(q, k, v) -> bool:
    return len({q.data_ptr(), k.data_ptr(), v.data_ptr()}) < 3


def same_bits(a, b) -> bool:
    """Are ``a`` and ``b`` the same tensor bit for bit (NaNs included), or both None?"""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _shape(key) -> str:
    return f"q {tuple(key[0])}, k {tuple(key[3])}, {key[2]}, return_lse={key[-1]}"
