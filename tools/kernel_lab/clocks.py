"""The SM clock and board power each contender runs at, next to its time: every contender of
short_walks.py (and FA4's built-in kernel on the causal twin) calls its step back to back for
about ``--seconds`` (no L2 flush, after half a second idle, the order rotating each round) while
nvidia-smi samples ``clocks.sm`` and ``power.draw.instant`` every 20 ms.

    python tools/kernel_lab/clocks.py --out results/ [--scenarios S2-128,S2-256] [--rounds 3] [--seconds 1]

Why: these kernels run the H200 at its 700 W limit (715-731 W instantaneous on S2), and it does
not give each the same clock: on S2 d128 FA4's sparse call settled at 1575 MHz and the same tiles
dealt longest first (FA4's varlen form, query chunks as batches) at 1500 MHz, triton at 1590-1635,
FA4's built-in kernel at 1575-1605; d256 kernels at 1470-1545
(results/2026-12-04-fa4-chunk-order-clocks-h200.json, 2026-12-04-clocks-*-h200.json). So a
per-pair rate compares the work a kernel does per cycle and the clock it is given, and timing
methods that mix contenders (spanattn.bench.timing.turns_ms) or run each alone (do_bench
blocks) weigh the second differently. Reported per contender: ms per call, MHz, W, and the efficiency against
the built-in kernel per second (as short_walks.py) and per cycle (rates divided by clocks).
Each contender is checked first as in short_walks.py. Needs CUDA and nvidia-smi. Writes
``<date>-clocks-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from short_walks import CASES, checked_contenders  # noqa: E402  benchmarks/short_walks.py's contenders

from spanattn.bench.report import environment, result_path
from spanattn.bench.timing import rotated

SAMPLE_MS = 20
QUERY = "timestamp,clocks.sm,power.draw.instant"  # power.draw: a 1 s average, idle mixed in


def parse_samples(lines) -> list[tuple[float, float, float]]:
    """``(seconds since the epoch, MHz, W)`` of nvidia-smi's ``--query-gpu=QUERY --format=csv,
    noheader,nounits`` lines (its timestamps are the machine's local time)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or "N/A" in parts:
            continue
        stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        out.append((stamp, float(parts[1]), float(parts[2])))
    return out


def window(samples, t0: float, t1: float, settle: float = 0.2) -> dict:
    """Median clock and power of the samples inside ``[t0 + settle, t1]`` (the first ``settle``
    seconds of a block are the clock moving off its idle value)."""
    inside = [(c, w) for t, c, w in samples if t0 + settle <= t <= t1]
    if not inside:
        return {"mhz": None, "watts": None, "samples": 0}
    return {"mhz": statistics.median(c for c, _ in inside), "watts": statistics.median(w for _, w in inside),
            "samples": len(inside)}  # fmt: skip


def back_to_back_ms(fn, seconds: float) -> tuple[float, float, float]:
    """``(ms per call, t0, t1)`` of calls of ``fn`` queued back to back for about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(3, round(seconds * 1e3 / max(start.elapsed_time(end), 1e-3)))
    time.sleep(0.5)  # idle: every block starts from the same clock
    t0 = time.time()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, t0, time.time()


def run_case(sid: str, d: int, args, log) -> dict:
    row, timed = checked_contenders(sid, d, 1, "cuda", torch.bfloat16)
    names = list(timed)
    for n in names:
        timed[n][0]()
    blocks = {n: [] for n in names}
    for r in range(args.rounds):
        for n in rotated(names, r):
            blocks[n].append(back_to_back_ms(timed[n][0], args.seconds))
    log.flush()
    samples = parse_samples(pathlib.Path(log.name).read_text().splitlines())
    for n in names:
        runs = [{"ms": ms, **window(samples, t0, t1)} for ms, t0, t1 in blocks[n]]
        entry = row["contenders"].setdefault(n, {})
        entry.update(rounds=runs, ms=statistics.median(x["ms"] for x in runs))
        clocked = [x for x in runs if x["mhz"]]
        if clocked:
            entry.update(mhz=statistics.median(x["mhz"] for x in clocked),
                         watts=statistics.median(x["watts"] for x in clocked))  # fmt: skip
    light = row["contenders"].get("fa4-builtin")
    for n in names if light else []:
        if n == "fa4-builtin":
            continue
        e, pairs = row["contenders"][n], timed[n][1]
        ratio = (pairs / e["ms"]) / (timed["fa4-builtin"][1] / light["ms"])
        e["efficiency"] = ratio
        if e.get("mhz") and light.get("mhz"):
            e["efficiency_per_cycle"] = ratio * light["mhz"] / e["mhz"]
    return row


def _line(row) -> str:
    parts = []
    for n, c in row["contenders"].items():
        if "ms" not in c:
            parts.append(f"{n}: {c.get('status') or c.get('check')}")
            continue
        clock = f" {c['mhz']:.0f} MHz {c['watts']:.0f} W" if c.get("mhz") else ""
        eff = (
            f" eff {c['efficiency']:.3f} / cycle {c.get('efficiency_per_cycle', 0):.3f}"
            if "efficiency" in c
            else ""
        )
        parts.append(f"{n} {c['ms']:.3f} ms{clock}{eff}")
    return f"{row['scenario']} d{row['d']}: " + " | ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--scenarios", default="S2-128,S2-256", help="comma-separated id-head_dim, e.g. S0-128")
    ap.add_argument("--rounds", type=int, default=3, help="blocks per contender")
    ap.add_argument("--seconds", type=float, default=1.0, help="length of a block of calls")
    args = ap.parse_args(argv)
    known = {f"{s}-{d}": (s, d) for s, d in CASES}
    cases = list(filter(None, args.scenarios.split(",")))
    unknown = [c for c in cases if c not in known]
    if unknown:
        ap.error(f"--scenarios: {', '.join(unknown)} not among {', '.join(known)}")
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print("clocks.py needs a CUDA GPU and nvidia-smi")
        return 2
    env = environment("cuda")
    path = result_path(args.out, "clocks", env)
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                "-lms", str(SAMPLE_MS)], stdout=log)  # fmt: skip
        try:
            for case in cases:
                rows.append(run_case(*known[case], args, log))
                print(_line(rows[-1]), flush=True)
                meta = {**env, "rounds": args.rounds, "seconds": args.seconds, "sample_ms": SAMPLE_MS}
                path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        finally:
            smi.terminate()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
