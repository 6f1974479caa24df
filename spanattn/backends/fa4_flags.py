"""A step whose sequences are causal or not, without spans, on FA4's built-in kernels: one launch
per causal flag, both writing one output.

FA4's built-in mask is one flag and one window for the whole launch, so a batch of causal chunks
and non-causal canvases takes two launches over the same packed q, k, v: each launch sees every
sequence (``cu_seqlens_q``) but uses the queries of its own flag's sequences only (``seqused_q``
0 elsewhere, so the other flag's rows are neither read nor written) and writes into the output
and LSE the call shares. Launched one after the other on one stream, the second waits for the
first one's last tiles; so the launch whose rows walk more keys runs on a side stream and starts
first, and the other fills the SMs as its tiles finish. On S4 (H200, 9 alternating rounds, per
pair against FA4's built-in kernel on the all-causal twin): side stream 1.000, one stream with
the longer walks first 0.998, shorter first 0.991, the sparse path (one launch, a mask_mod on
the chunks' diagonal tiles) 0.945 (results/2026-12-04-fa4-flag-launches-h200.json). Host time:
two recorded calls and the stream fork and join, 0.13 ms a call (one launch 0.03-0.06).

Sharing the output needs FA4's inner forward (``interface._flash_attn_fwd``: ``out=``, ``lse=``,
``seqused_q=``); its public functions allocate their own. Where that is missing,
``unavailable`` says so and the step is not run on fa4.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

NEEDS = ("out", "lse", "seqused_q", "cu_seqlens_q", "window_size_left", "window_size_right")


@functools.cache
def inner_forward():
    """FA4's inner forward if it takes everything two shared-output launches need, else None."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # fa4.unavailable reports the import itself
        return None
    fwd = getattr(sys.modules[flash_attn_varlen_func.__module__], "_flash_attn_fwd", None)
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return None
    return fwd if all(n in params for n in NEEDS) else None


def keys_per_row(s, layer) -> float:
    """About how many keys a row of sequence ``s`` walks under ``layer``, spans left out (host
    arithmetic on the batch: no device sync)."""
    w = layer.window
    if s.causal:  # row i sees kv_len - q_len + i + 1 keys, at most W
        mean = s.kv_len - (s.q_len - 1) / 2
        return mean if w is None else min(mean, w)
    wide = layer.noncausal_window == "inclusive"
    return s.kv_len if w is None else min(s.kv_len, 2 * w + (1 if wide else -1))


def mean_walk(seqs, layer) -> float:
    """``keys_per_row`` averaged over the rows of ``seqs``."""
    return sum(keys_per_row(s, layer) * s.q_len for s in seqs) / max(1, sum(s.q_len for s in seqs))


def flags(plan) -> tuple[bool, ...]:
    """The causal flags of the plan's sequences, one launch each, the launch whose rows walk more
    keys on average first."""
    seqs = plan.batch.seqs
    walk = lambda c: mean_walk([s for s in seqs if s.causal == c], plan.layer)
    present = {s.causal for s in seqs}
    return tuple(sorted(present, key=walk, reverse=True))


def window(plan, causal: bool) -> tuple[int | None, int | None]:
    """FA4's ``(left, right)`` window for the rows of one flag (bottom-right aligned, as ours)."""
    w = plan.layer.window
    if w is None:
        return None, None
    if causal:
        return w - 1, 0
    reach = w if plan.layer.noncausal_window == "inclusive" else w - 1
    return reach, reach


def used_queries(plan, causal: bool) -> torch.Tensor:
    """int32 ``[num_seqs]``: each sequence's query count where its flag is ``causal``, else 0."""
    build = lambda: torch.tensor([s.q_len if s.causal == causal else 0 for s in plan.batch.seqs],
                                 dtype=torch.int32, device=plan.device)  # fmt: skip
    return plan.cached(("fa4_used_queries", causal), build)


def shared_output_forward(q, k, v, *, out, lse, softmax_scale, softcap, return_lse, window_size, **fixed):
    """FA4's inner forward into ``out`` (and ``lse``), in the public functions' ``(out, lse)``
    form; ``fixed`` are the varlen lengths, ``seqused_q`` and ``causal``."""
    left, right = window_size
    got = inner_forward()(q, k, v, out=out, lse=lse if return_lse else None, softmax_scale=softmax_scale,
                          softcap=softcap, return_lse=return_lse, window_size_left=left,
                          window_size_right=right, **fixed)  # fmt: skip
    return got[0], got[1] if return_lse else None


_side_streams: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


class FlagLaunches:
    """The DirectCalls of one launch per flag (``flags`` order), called as one DirectCall is::

        out, lse = FlagLaunches(calls)(q, k, v, scale, softcap, return_lse)

    On CUDA the first runs on a side stream forked from the current one and joined back before
    returning (so the caller's stream orders every later use and free of the tensors)."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, q, k, v, scale, softcap, return_lse):
        out = torch.empty_like(q)
        lse = None
        if return_lse:  # FA4's varlen LSE: [Hq, total_q]
            lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        first, rest = self.calls[0], self.calls[1:]
        if q.is_cuda:
            main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                first(q, k, v, scale, softcap, return_lse, out=out, lse=lse)
        else:
            first(q, k, v, scale, softcap, return_lse, out=out, lse=lse)
        for call in rest:
            call(q, k, v, scale, softcap, return_lse, out=out, lse=lse)
        if q.is_cuda:
            main.wait_stream(side)
        return out, lse
