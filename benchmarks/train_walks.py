"""Training speed per useful pair on the training scenarios (T0-T3, T3g, T5): the backward alone
and forward + backward, every contender's gradients checked in the same call, the contenders
alternating.

    python benchmarks/train_walks.py --out results/ [--rounds 5] [--cases T1-128,T5-512] [--scale 1]

Contenders: the spanattn backends that train the step (triton; fa4 where FA4's own backward
runs it; flex, FlexAttention's compiled kernels and backward from the plan's BlockMask; sdpa
with each sequence's dense mask), SDPA's causal kernel on T5 (``is_causal``: the one d512
backward there is), and FA4's built-in causal/window backward on the step's causal twin (every
sequence causal, spans off, the same window): the speed of light per pair, the mask it cannot
express left out. FLOPs count allowed pairs only: backward ``10 * D * Hq * pairs``, forward +
backward ``14 * D * Hq * pairs`` (the FA2/FA3 convention). Efficiency: a contender's backward
rate per allowed pair over FA4's built-in backward's on its own pairs, per round, medians.

Checks, before any timing: each contender's dq, dk, dv (and the LSE's gradient for spanattn's
backends) against the fp64 truth by the rule of spanattn.oracle.GradTruth on the step scaled
down 8x (fresh inputs, NaN-poisoned memory); at full size, two backward calls of each spanattn
backend bit for bit equal (determinism). Peak memory of one forward + backward beyond q, k, v,
the output gradient and the results. Without a GPU: the dense backends (and triton under
TRITON_INTERPRET=1) at ``--scale 64``, a smoke run. Writes ``<date>-train-walks-<gpu>.json`` and
a PNG of the efficiencies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch._functorch.config
from short_walks import _builtin, _causal_twin, _time_ms  # this folder (FA4's call: autograd runs through it)
from short_walks import _inputs as short_walks_inputs

import spanattn as sa
from spanattn.bench.report import environment, labelled_bars, pyplot, result_path
from spanattn.bench.timing import rotated
from spanattn.oracle import GradTruth
from spanattn.scenarios import HQ, training_scenarios

# The backward alone is timed again and again on one forward's graph (retain_graph), which
# compiled graphs with donated buffers (FlexAttention's) refuse.
torch._functorch.config.donated_buffer = False

CASES = [("T0", 128), ("T0", 256), ("T1", 128), ("T1", 256), ("T2", 128), ("T2", 256), ("T3", 128),
         ("T3", 256), ("T3g", 128), ("T3g", 256), ("T5", 512)]  # fmt: skip
BACKENDS = ("triton", "fa4", "flex", "sdpa")


def _inputs(plan, d, dtype, seed):
    return [t.requires_grad_() for t in short_walks_inputs(plan, d, dtype, seed)]


def _backend(name: str, d: int):
    """``(trains(q, plan) -> str | None, step(q, k, v, plan) -> out)`` of a spanattn backend."""
    mod = sa.backends.load(name)

    def trains(q, p):
        return mod.unavailable(q, p, scale=d**-0.5) or mod.no_backward(q, p)

    return trains, lambda q, k, v, p: sa.attention(q, k, v, p, backend=name)


def _sdpa_causal(d: int):
    """torch SDPA with ``is_causal`` over one causal sequence (its memory-efficient kernel at d512)."""
    import torch.nn.functional as F

    def runs(q, p):
        one = p.num_seqs == 1 and p.layer.window is None and p.batch.seqs[0].causal
        return None if one and not any(s.spans for s in p.batch.seqs) else "one causal sequence only"

    def step(q, k, v, p):
        qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=d**-0.5, enable_gqa=True)
        return o[0].transpose(0, 1)

    return runs, step


def _gluon_asked(fn):
    """``fn`` with ``SPANATTN_TRITON_GLUON=1``: the triton backend's Gluon kernels that run only
    when asked for (its Gluon backward) against the same backend without them."""
    from spanattn.backends.triton import GLUON_ENV

    def run(*args):
        before = os.environ.get(GLUON_ENV)
        os.environ[GLUON_ENV] = "1"
        try:
            return fn(*args)
        finally:
            os.environ.pop(GLUON_ENV) if before is None else os.environ.__setitem__(GLUON_ENV, before)

    return run


def _fa4_mask_mod(d: int):
    """FA4's non-varlen kernel over the packed step as one sequence with the interval
    ``mask_mod`` (spanattn.backends.fa4's), no block sparsity, and its backward: what FA4 trains a
    step like this with, lacking our tables. A row's keys are ``[cu_k + lo, cu_k + hi]`` of the
    packed keys (nothing across sequences), as ``[lo, width]``; empty rows never match."""
    from spanattn.backends.fa4 import EMPTY_LO, _interval_mask_mod

    def runs(q, p):
        if q.device.type != "cuda" or d > 256:
            return "FA4's Hopper backward takes head_dim up to 256 on a GPU"
        try:
            import flash_attn.cute  # noqa: F401
        except ImportError as e:
            return f"flash-attn-4 is not installed ({e})"
        return None

    def aux(p):
        seq = torch.repeat_interleave(torch.arange(p.num_seqs, device=p.lo.device), p.cu_seqlens_q.diff())
        real = p.hi >= p.lo
        lo = torch.where(real, p.cu_seqlens_k[seq] + p.lo, EMPTY_LO).to(torch.int32)
        return [lo, torch.where(real, p.hi - p.lo, 0).to(torch.int32)]

    def step(q, k, v, p):
        from flash_attn.cute import flash_attn_func

        tensors = p.cached(("train_walks.fa4_mask_mod",), lambda: aux(p))
        out = flash_attn_func(q[None], k[None], v[None], softmax_scale=d**-0.5, causal=False,
                              mask_mod=_interval_mask_mod(), aux_tensors=tensors)  # fmt: skip
        return (out[0] if isinstance(out, tuple) else out)[0]

    return runs, step


def contenders(d: int, device: str) -> dict:
    """name -> (why it cannot train the step or None, step): what this machine can time
    (``triton+gluon-bwd``: triton with its Gluon backward asked for, timed and checked so)."""
    names = BACKENDS if device == "cuda" else ("triton", "sdpa", "reference")
    out = {n: _backend(n, d) for n in names if n in sa.backends.BACKENDS}
    if device == "cuda":
        trains, step = _backend("triton", d)
        out["triton+gluon-bwd"] = (trains, _gluon_asked(step))
        out["fa4 mask_mod"] = _fa4_mask_mod(d)
    if device == "cuda" and d == 512:
        out["sdpa causal"] = _sdpa_causal(d)
    return out


def _check(trains, step, small, d, dtype, device, backend: str | None) -> dict:
    """``backend``: a spanattn backend's name (its LSE's gradient is checked too), else None."""
    p = sa.plan(small.batch, small.layer, device)
    q, k, v = _inputs(p, d, dtype, seed=1)
    why = trains(q, p)
    if why is not None:
        return {"ok": None, "why": f"cannot run the scaled-down step: {why}"}
    torch.full((8 * q.numel(),), float("nan"), device=device)  # poison what the gradients will reuse
    g = torch.Generator(device=device).manual_seed(2)
    dout = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
    if backend is not None:
        dlse = torch.randn(q.shape[:2], generator=g, device=device)
        out, lse = sa.attention(q, k, v, p, backend=backend, return_lse=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    else:
        dlse = None
        grads = torch.autograd.grad(step(q, k, v, p), (q, k, v), dout)
    verdict = GradTruth(q, k, v, p, dout, dlse, scale=d**-0.5).check(*grads, rounding_slack=True)
    return verdict.as_dict()


def _peak_mb(fwd_bwd, device) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads
    return round(peak / 2**20, 1)


def run_case(sid: str, d: int, args, device: str, dtype) -> dict:
    sc = training_scenarios(args.scale)[sid]
    small = training_scenarios(args.scale * (8 if device == "cuda" else 1))[sid]
    p = sa.plan(sc.batch, sc.layer, device)
    q, k, v = _inputs(p, d, dtype, seed=0)
    dout = torch.randn_like(q)
    row = {"scenario": sid, "d": d, "what": sc.what, "allowed_pairs": p.allowed_pairs(), "contenders": {}}
    timed = {}  # name -> (fwd_bwd(), bwd(), pairs)
    for name, (trains, step) in contenders(d, device).items():
        if args.contenders and name not in args.contenders.split(","):
            continue
        why = trains(q, p)
        if why is not None:
            row["contenders"][name] = {"status": f"cannot train this step: {why}"}
            continue
        ours = name if name in sa.backends.BACKENDS else None
        try:
            entry = row["contenders"][name] = {"check": _check(trains, step, small, d, dtype, device, ours)}
        except Exception as e:  # a peer that fails on the step: recorded, not timed
            if ours:
                raise
            row["contenders"][name] = {"status": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        if entry["check"].get("ok") is False:
            continue
        fwd_bwd = lambda s=step: torch.autograd.grad(s(q, k, v, p), (q, k, v), dout)
        try:
            entry["peak_mb"] = _peak_mb(fwd_bwd, device)
            out = step(q, k, v, p)
            bwd = lambda o=out: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
            if name == "triton+gluon-bwd":
                fwd_bwd, bwd = _gluon_asked(fwd_bwd), _gluon_asked(bwd)
            if ours:
                entry["deterministic"] = all(torch.equal(a, b) for a, b in zip(bwd(), bwd()))
        except (torch.OutOfMemoryError, RuntimeError) as e:  # a peer that cannot run it at full size
            entry["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            continue
        timed[name] = (fwd_bwd, bwd, p.allowed_pairs())
    light = _builtin(d) if device == "cuda" else None
    if light is not None:
        tp = sa.plan(*_causal_twin(sc), device)
        out = light(q, k, v, tp)
        timed["fa4-builtin"] = (lambda: torch.autograd.grad(light(q, k, v, tp), (q, k, v), dout),
                                lambda o=out: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True),
                                tp.allowed_pairs())  # fmt: skip
        row["contenders"]["fa4-builtin"] = {"note": "speed of light: the causal twin's mask, not checked"}
    names = list(timed)
    rounds = {(n, part): [] for n in names for part in ("fwd_bwd", "bwd")}
    for r in range(args.rounds):
        for n in rotated(names, r):
            for i, part in enumerate(("fwd_bwd", "bwd")):
                rounds[n, part].append(_time_ms(timed[n][i], device, args.reps))
    for n in names:
        pairs, entry = timed[n][2], row["contenders"][n]
        for part, flops in (("fwd_bwd", 14), ("bwd", 10)):
            ms = statistics.median(rounds[n, part])
            entry[f"{part}_ms"], entry[f"{part}_rounds_ms"] = ms, rounds[n, part]
            entry[f"{part}_tflops"] = flops * d * HQ * pairs / (ms * 1e-3) / 1e12
        if "fa4-builtin" in timed and n != "fa4-builtin":
            lp = timed["fa4-builtin"][2]
            per_round = [
                (pairs / t) / (lp / t0) for t, t0 in zip(rounds[n, "bwd"], rounds["fa4-builtin", "bwd"])
            ]
            entry["bwd_efficiency"] = statistics.median(per_round)
    return row


def _line(row) -> str:
    parts = []
    for n, c in row["contenders"].items():
        if "bwd_ms" in c:
            eff = f" eff {c['bwd_efficiency']:.3f}" if "bwd_efficiency" in c else ""
            mem = f" {c['peak_mb']:.0f} MB" if c.get("peak_mb") is not None else ""
            parts.append(f"{n} bwd {c['bwd_ms']:.3f} ms {c['bwd_tflops']:.0f} TF{eff}, "
                         f"fwd+bwd {c['fwd_bwd_ms']:.3f} ms {c['fwd_bwd_tflops']:.0f} TF{mem}")  # fmt: skip
        else:
            parts.append(f"{n}: {c.get('status') or c.get('check')}")
    return f"{row['scenario']} d{row['d']}: " + " | ".join(parts)


def _draw(path, rows) -> None:
    plt = pyplot()
    cases = [r for r in rows if any("bwd_tflops" in c for c in r["contenders"].values())]
    if plt is None or not cases:
        return
    names = sorted({n for r in cases for n, c in r["contenders"].items() if "bwd_tflops" in c})
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(cases)), 4))
    labelled_bars(ax, cases, names, "bwd_tflops", ".0f", fontsize=6)
    ax.set_ylabel("backward TFLOP/s over allowed pairs")
    ax.set_title("Backward: 10 * D * Hq * allowed pairs / time (medians of alternating rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and PNG")
    ap.add_argument("--cases", default="", help="comma-separated id-head_dim (T1-128) or ids, run in "
                    "this order; default all")  # fmt: skip
    ap.add_argument("--contenders", default="", help="comma-separated names to time (default all here; "
                    "FA4's built-in backward is timed wherever FA4 runs)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per step")
    ap.add_argument("--reps", type=int, default=5, help="a contender's time per round and part, in 10 ms")
    ap.add_argument("--scale", type=int, default=None, help="divide token counts (default 1; 64 on CPU)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.scale = args.scale or (1 if device == "cuda" else 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    only = list(filter(None, args.cases.split(",")))
    unknown = set(only) - {sid for sid, _ in CASES} - {f"{sid}-{d}" for sid, d in CASES}
    if unknown:
        ap.error(f"--cases: {', '.join(sorted(unknown))} not among {', '.join(f'{s}-{d}' for s, d in CASES)}")
    env = environment(device)
    path = result_path(args.out, "train-walks", env)
    rows = []
    # in the order asked (the JSON is written after each case: a run cut short keeps the first)
    order = [c for want in only for c in CASES if want in (c[0], f"{c[0]}-{c[1]}")] if only else CASES
    for sid, d in order:
        rows.append(run_case(sid, d, args, device, dtype))
        print(_line(rows[-1]), flush=True)
        meta = {**env, "scale": args.scale, "rounds": args.rounds, "flops": "backward 10 * D * Hq * pairs, "
                "forward + backward 14 * D * Hq * pairs (allowed pairs only)"}  # fmt: skip
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        if device == "cuda":
            torch.cuda.empty_cache()
    _draw(path.with_suffix(".png"), rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
