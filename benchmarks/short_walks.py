"""How well each useful pair is computed on the standard scenarios, against FA4's built-in kernel,
in one call with the contenders alternating: the triton backend as it runs by default (the Gluon
kernels' persistent launch on Hopper), the same kernels with one program per work item, and the
fa4 backend.

    python benchmarks/short_walks.py --out results/ [--rounds 7] [--scenarios S1,S3-256] [--scale 1]

Efficiency (docs/design.md section 5): TFLOP/s over the step's allowed pairs divided by FA4's built-in
causal/window kernel's TFLOP/s over its own pairs, on the step's causal twin (every sequence
causal, spans off, the same window: what it can run), per round, medians over rounds; 1.0 = as
well as FA4's plain kernel. In a round each contender times a block of calls (``do_bench``),
the order rotating; ``--timing turns`` has them take turns call by call instead, which removes the
drift between blocks but runs every call at a clock the contenders share (the H200 gives kernels
different clocks: tools/kernel_lab/clocks.py). Each contender is checked first on the scenario
scaled down 8x (fresh inputs, NaN-poisoned outputs, docs/design.md section 4's rule) and, at full
size, the persistent launch must equal the one-program-per-item launch bit for bit. Without a GPU
it runs the triton backend alone at ``--scale 64`` (a smoke run). Writes
``<date>-short-walks-<gpu>.json`` and a PNG of the efficiencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

import spanattn as sa
from spanattn.bench.report import environment, labelled_bars, pyplot, result_path
from spanattn.bench.timing import rotated, turns_ms
from spanattn.oracle import Truth
from spanattn.scenarios import HKV, HQ, scenarios

CASES = [("S0", 128), ("S0", 256), ("S1", 128), ("S1", 256), ("S2", 128), ("S2", 256), ("S3", 256),
         ("S4", 128), ("S5", 512)]  # fmt: skip
TARGETS = {"triton": 0.95, "best": 1.0}


def _inputs(plan, d, dtype, seed):
    g = torch.Generator(device=plan.device).manual_seed(seed)
    shapes = ((plan.total_q, HQ), (plan.total_k, HKV), (plan.total_k, HKV))
    return [torch.randn(n, h, d, generator=g, device=plan.device, dtype=dtype) for n, h in shapes]


def _causal_twin(sc):
    """The step FA4's built-in kernel can run: every sequence causal, no spans, the same window."""
    seqs = [sa.Seq(q_len=s.q_len, kv_len=s.kv_len) for s in sc.batch.seqs]
    return sa.Batch(seqs), sa.LayerMask(window=sc.layer.window, spans="off")


def contenders(d: int, device: str) -> dict:
    """name -> (runs(q, k, v, plan) -> bool, call(q, k, v, plan) -> out): what this machine can time."""
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick_gluon

    scale = d**-0.5
    out = {"triton": (lambda q, k, v, p: tb.unavailable(q, p) is None,
                      lambda q, k, v, p: tb.forward(q, k, v, p, scale=scale)[0])}  # fmt: skip
    cfg = pick_gluon(d, torch.bfloat16)
    if device == "cuda" and cfg is not None:
        per_item = replace(cfg, persistent=False)
        out["triton, one program per item"] = (
            lambda q, k, v, p: tb.uses_gluon(q, k, v, p, cfg),
            lambda q, k, v, p: tb.forward(q, k, v, p, scale=scale, config=per_item)[0],
        )  # fmt: skip
    if device == "cuda" and d <= 256:
        from spanattn.backends import fa4

        out["fa4"] = (lambda q, k, v, p: fa4.unavailable(q, p) is None,
                      lambda q, k, v, p: fa4.forward(q, k, v, p, scale=scale)[0])  # fmt: skip
    return out


def _builtin(d: int):
    """FA4's built-in causal/window call, or None where FA4 is absent or stops short of ``d``."""
    if d > 256:
        return None
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # optional peer: any import failure means "not here"
        return None

    def call(q, k, v, p):
        w = p.layer.window
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                                      max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k,
                                      softmax_scale=d**-0.5, causal=True,
                                      window_size=(None, None) if w is None else (w - 1, 0))[0]  # fmt: skip

    return call


def _check(runs, call, sc_small, d, dtype, device) -> dict:
    p = sa.plan(sc_small.batch, sc_small.layer, device)
    q, k, v = _inputs(p, d, dtype, seed=1)
    if not runs(q, k, v, p):
        return {"ok": None, "why": "cannot run the scaled-down step"}
    torch.full((4 * q.numel(),), float("nan"), device=device)  # poison what the output will reuse
    out = call(q, k, v, p)
    verdict = Truth(q, k, v, p, scale=d**-0.5).check(out, rounding_slack=True)
    return {"ok": bool(verdict.ok), "err": verdict.err, "bound": verdict.bound}


def _time_ms(fn, device, reps: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=reps * 10, return_mode="median"))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def checked_contenders(sid: str, d: int, scale: int, device: str, dtype) -> tuple[dict, dict]:
    """The step's row (each contender's check, or why it cannot run) and ``name -> (call(),
    allowed pairs)`` of the contenders that passed, FA4's built-in kernel on the causal twin last
    (``fa4-builtin``, where FA4 is here). Checked on the step scaled down 8x on the GPU (fp64
    truth of a 32k step is heavy); a smoke run's steps are small already."""
    sc, small = scenarios(scale)[sid], scenarios(scale * (8 if device == "cuda" else 1))[sid]
    p = sa.plan(sc.batch, sc.layer, device)
    q, k, v = _inputs(p, d, dtype, seed=0)
    row = {"scenario": sid, "d": d, "allowed_pairs": p.allowed_pairs(), "contenders": {}}
    timed = {}
    for name, (runs, call) in contenders(d, device).items():
        if not runs(q, k, v, p):
            row["contenders"][name] = {"status": "cannot run this step"}
            continue
        check = _check(runs, call, small, d, dtype, device)
        row["contenders"][name] = {"check": check}
        if check["ok"] is not False:
            timed[name] = (lambda c=call: c(q, k, v, p), p.allowed_pairs())
    builtin = _builtin(d) if device == "cuda" else None
    if builtin is not None:
        tp = sa.plan(*_causal_twin(sc), device)
        timed["fa4-builtin"] = (lambda: builtin(q, k, v, tp), tp.allowed_pairs())
    return row, timed


def run_case(sid: str, d: int, args, device: str, dtype) -> dict:
    row, timed = checked_contenders(sid, d, args.scale, device, dtype)
    if "triton, one program per item" in timed:
        a, b = (timed[n][0]() for n in ("triton", "triton, one program per item"))
        row["persistent_equals_per_item"] = bool(torch.equal(a, b))
    names = list(timed)
    for n in names:  # tables, compilation and FA4's recorded call outside every round
        timed[n][0]()
    rounds = {n: [] for n in names}
    if args.timing == "turns":
        fns = {n: timed[n][0] for n in names}
        fastest = min(_time_ms(f, device, 1) for f in fns.values())
        calls = max(5, min(200, round(args.reps * 10 / max(fastest, 1e-3))))  # ~reps * 10 ms each
        for r in range(args.rounds):
            for n, ms in turns_ms(fns, device, calls, first=r).items():
                rounds[n].append(statistics.median(ms))
    else:
        for r in range(args.rounds):
            for n in rotated(names, r):
                rounds[n].append(_time_ms(timed[n][0], device, args.reps))
    for n in names:
        ms, pairs = statistics.median(rounds[n]), timed[n][1]
        entry = row["contenders"].setdefault(n, {})
        entry.update(ms=ms, rounds_ms=rounds[n], tflops=4 * d * HQ * pairs / (ms * 1e-3) / 1e12)
        if "fa4-builtin" in timed and n != "fa4-builtin":
            light = timed["fa4-builtin"][1]
            per_round = [(pairs / t) / (light / t0) for t, t0 in zip(rounds[n], rounds["fa4-builtin"])]
            entry["efficiency"] = statistics.median(per_round)
    if "triton, one program per item" in timed:
        per_round = [b / a for a, b in zip(rounds["triton"], rounds["triton, one program per item"])]
        row["persistent_speedup"] = statistics.median(per_round)
    return row


def _line(row) -> str:
    parts = []
    for n, c in row["contenders"].items():
        if "ms" in c:
            eff = f" eff {c['efficiency']:.3f}" if "efficiency" in c else ""
            parts.append(f"{n} {c['ms']:.3f} ms {c['tflops']:.0f} TF{eff}")
        else:
            parts.append(f"{n}: {c.get('status') or c.get('check')}")
    extra = f" | persistent x{row['persistent_speedup']:.3f}" if "persistent_speedup" in row else ""
    return f"{row['scenario']} d{row['d']}: " + " | ".join(parts) + extra


def _draw(path, rows) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [n for n in ("triton", "triton, one program per item", "fa4")
             if any("efficiency" in r["contenders"].get(n, {}) for r in rows)]  # fmt: skip
    cases = [r for r in rows if any("efficiency" in r["contenders"].get(n, {}) for n in names)]
    if not cases:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    labelled_bars(ax, cases, names, "efficiency", ".2f")
    for level in sorted(set(TARGETS.values())):
        ax.axhline(level, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("per-pair rate / FA4 built-in's")
    ax.set_title("Efficiency per useful pair (medians of alternating rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and PNG")
    ap.add_argument(
        "--scenarios",
        default="",
        help="comma-separated ids, or id-head_dim for one of a "
        "scenario's head_dims (S1-256); default all of S0-S5",
    )
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds per step")
    ap.add_argument("--reps", type=int, default=10, help="a contender's time per round, in 10 ms")
    ap.add_argument(
        "--timing",
        choices=("turns", "blocks"),
        default="blocks",
        help="blocks: each contender times a block of calls in turn (do_bench), each at the clock "
        "the GPU gives it alone; turns: they take turns call by call (spanattn.bench.timing.turns_ms), "
        "at a clock they share",
    )
    ap.add_argument("--scale", type=int, default=None, help="divide token counts (default 1; 64 on CPU)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.scale = args.scale or (1 if device == "cuda" else 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    only = set(filter(None, args.scenarios.split(",")))
    unknown = only - {sid for sid, _ in CASES} - {f"{sid}-{d}" for sid, d in CASES}
    if unknown:
        ap.error(
            f"--scenarios: {', '.join(sorted(unknown))} not among {', '.join(f'{s}-{d}' for s, d in CASES)}"
        )
    env = environment(device)
    path = result_path(args.out, "short-walks", env)
    rows = []
    for sid, d in CASES:
        if only and sid not in only and f"{sid}-{d}" not in only:
            continue
        rows.append(run_case(sid, d, args, device, dtype))
        print(_line(rows[-1]), flush=True)
        meta = {**env, "scale": args.scale, "rounds": args.rounds, "timing": args.timing, "targets": TARGETS}
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        if device == "cuda":
            torch.cuda.empty_cache()
    _draw(path.with_suffix(".png"), rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
