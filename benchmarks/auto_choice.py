"""Does ``backend="auto"`` run each kind of step on the faster of the two fast backends? Each
step runs on fa4 and on triton through ``spanattn.attention`` (the calls users make), both
checked first and then timed alternating; the row says which backend auto picks and how its time
compares with the faster one's.

    python benchmarks/auto_choice.py --out results/ [--rounds 5] [--cases S1-128,S2-256/4]

Steps: docs/design.md section 5's S0-S2 and S4 at their head_dims, ``S1-text`` (S1's sliding layer
over the same tokens without images: FA4's own window kernel, no spans) and, with ``/4``, S1,
S1-text and S2 at a quarter of the tokens (8k: a short prompt, fewer waves of tiles; ``/2``:
16k). Per round each backend times a block of calls (``do_bench``, L2 flushed), the order
rotating, then the two take turns call by call (``turns_ms``); a ratio is the median over
rounds of the two times in that round (auto's over the faster one's, triton's over fa4's).
Each backend is first checked on the step scaled down 8x (fresh inputs, NaN-poisoned outputs,
docs/design.md section 4's rule); one that fails is not timed. Without a GPU a smoke run: the triton
interpreter alone on toy sizes. Writes ``<date>-auto-choice-<gpu>.json`` and a PNG of the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch
from short_walks import _check, _inputs, _time_ms  # this folder

import spanattn as sa
from spanattn.bench.report import environment, pyplot, result_path
from spanattn.bench.timing import rotated, turns_ms
from spanattn.scenarios import scenarios

CASES = [("S0", 128, 1), ("S0", 256, 1), ("S1", 128, 1), ("S1", 256, 1), ("S1-text", 128, 1),
         ("S1-text", 256, 1), ("S2", 128, 1), ("S2", 256, 1), ("S4", 128, 1), ("S2", 128, 2),
         ("S1", 128, 4), ("S1", 256, 4), ("S1-text", 128, 4), ("S1-text", 256, 4), ("S2", 128, 4),
         ("S2", 256, 4)]  # fmt: skip
FAST = ("fa4", "triton")


def case_name(sid: str, d: int, scale: int) -> str:
    return f"{sid}-{d}" + ("" if scale == 1 else f"/{scale}")


def step(sid: str, scale: int):
    """The scenario's batch and layer; ``S1-text``: S1 without its images."""
    if sid == "S1-text":
        sc = scenarios(scale)["S1"]
        return sa.Batch([replace(s, spans=()) for s in sc.batch.seqs]), replace(sc.layer, spans="off")
    sc = scenarios(scale)[sid]
    return sc.batch, sc.layer


def run_case(name: str, sid: str, d: int, scale: int, args, device: str, dtype) -> dict:
    batch, layer = step(sid, scale)
    p = sa.plan(batch, layer, device)
    q, k, v = _inputs(p, d, dtype, seed=0)
    row = {"case": name, "d": d, "auto": sa.auto_choice(q, p), "backends": {}}
    small_batch, small_layer = step(sid, scale * (8 if device == "cuda" else 1))
    small = argparse.Namespace(batch=small_batch, layer=small_layer)
    timed = {}
    for backend in FAST:
        mod = sa.backends.load(backend)
        runs = lambda q, k, v, p, mod=mod: mod.unavailable(q, p, softcap=None, return_lse=False) is None
        call = lambda q, k, v, p, b=backend: sa.attention(q, k, v, p, backend=b)
        if not runs(q, k, v, p):
            row["backends"][backend] = {"status": "cannot run this step"}
            continue
        check = _check(runs, call, small, d, dtype, device)
        row["backends"][backend] = {"check": check}
        if check["ok"] is not False:
            timed[backend] = lambda c=call: c(q, k, v, p)
    for fn in timed.values():  # compilation, tables and recorded calls outside the rounds
        fn()
    names = list(timed)
    blocks, turns = {n: [] for n in names}, {n: [] for n in names}
    if names:
        calls = max(5, min(100, round(args.reps * 10 / max(_time_ms(timed[names[0]], device, 1), 1e-3))))
    for r in range(args.rounds if names else 0):
        for n in rotated(names, r):
            blocks[n].append(_time_ms(timed[n], device, args.reps))
        for n, ms in turns_ms(timed, device, calls, first=r).items():
            turns[n].append(statistics.median(ms))
    for how, rounds in (("blocks", blocks), ("turns", turns)):
        for n in names:
            row["backends"][n][f"{how}_ms"] = statistics.median(rounds[n])
            row["backends"][n][f"{how}_rounds_ms"] = rounds[n]
        by_round = [{n: rounds[n][r] for n in names} for r in range(len(rounds[names[0]]) if names else 0)]
        if set(FAST) <= set(names):
            row[f"triton_over_fa4_{how}"] = statistics.median(t["triton"] / t["fa4"] for t in by_round)
        if row["auto"] in names and len(names) > 1:
            auto = [t[row["auto"]] / min(t.values()) for t in by_round]
            row[f"auto_over_fastest_{how}"] = statistics.median(auto)
            row[f"fastest_{how}"] = min(names, key=lambda n: statistics.median(rounds[n]))
    return row


def _line(row) -> str:
    parts = [f"{n} {b['blocks_ms']:.3f} / {b['turns_ms']:.3f} ms" if "blocks_ms" in b else f"{n}: {b}"
             for n, b in row["backends"].items()]  # fmt: skip
    ratio = ""
    if "auto_over_fastest_blocks" in row:
        blocks, turns = row["auto_over_fastest_blocks"], row["auto_over_fastest_turns"]
        ratio = f" | auto / fastest {blocks:.3f} / {turns:.3f}"
    return f"{row['case']}: auto -> {row['auto']} | " + " | ".join(parts) + ratio


def draw(path, rows) -> None:
    """Triton's time over fa4's per step (blocks and turns), each bar's label auto's pick."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if "triton_over_fa4_blocks" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(12, 4))
    for i, how in enumerate(("blocks", "turns")):
        xs = [c + (i - 0.5) * 0.4 for c in range(len(rows))]
        ys = [r[f"triton_over_fa4_{how}"] for r in rows]
        ax.bar(xs, ys, 0.4, label=how, bottom=0)
    for c, r in enumerate(rows):
        top = max(r["triton_over_fa4_blocks"], r["triton_over_fa4_turns"])
        ax.text(c, top + 0.005, f"auto: {r['auto']}", ha="center", fontsize=7, rotation=90, va="bottom")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylim(0.8, 1.3)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=30, fontsize=8)
    ax.set_ylabel("triton time / fa4 time (below 1: triton faster)")
    ax.set_title("Which backend is faster per step, and what backend='auto' runs (medians over rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and PNG")
    names = [case_name(*c) for c in CASES]
    ap.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(names)}; default all")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per step")
    ap.add_argument("--reps", type=int, default=10, help="a backend's time per round and timing, in 10 ms")
    ap.add_argument("--scale", type=int, default=None, help="divide token counts (default 1; 64 on CPU)")
    args = ap.parse_args(argv)
    only = set(filter(None, args.cases.split(",")))
    if only - set(names):
        ap.error(f"--cases: {', '.join(sorted(only - set(names)))} not among {', '.join(names)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.scale = args.scale or (1 if device == "cuda" else 64)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    env = environment(device)
    path = result_path(args.out, "auto-choice", env)
    rows = []
    for sid, d, scale in CASES:
        name = case_name(sid, d, scale)
        if only and name not in only:
            continue
        rows.append(run_case(name, sid, d, scale * args.scale, args, device, dtype))
        print(_line(rows[-1]), flush=True)
        meta = {**env, "scale": args.scale, "rounds": args.rounds}
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    draw(path.with_suffix(".png"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
