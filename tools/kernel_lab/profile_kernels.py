"""Hardware counters of the prefill kernels, the triton backend's against FA4's built-in kernel on
the same standard steps (Nsight Compute): how busy the tensor cores are, how many instructions
a step takes, how many SMs idle in the launch's tail, where warps wait.

    python tools/kernel_lab/profile_kernels.py --out results/ [--cases triton:S3-256,fa4:S1-256]

A case is ``who:SCENARIO-HEAD_DIM``: ``triton`` runs the scenario (bf16, Hq 16 / Hkv 8, random
inputs) through the triton backend's forward, ``fa4`` FA4's built-in causal/window kernel on
its causal twin (short_walks.py: what FA4 can run). The script runs itself under ``ncu --set
full --clock-control none`` (clocks left alone; each case warmed up and timed with CUDA events
first, then one call profiled), reads the counters back (``ncu -i ... --page raw``) and writes
``<date>-kernel-counters-<gpu>.json`` and a PNG of the tensor pipes' busy share per step.
Warp-state samples count every resident warp: the Gluon kernels' consumer and producer warps
and the three warps that only pad the producer's warpgroup (they wait at a barrier, issuing
nothing). ``--source`` adds, per kernel, where those samples sit: the SASS page's samples
summed by instruction kind (the CTA barrier the padding warps park at apart from a warpgroup's
own barriers, mbarrier waits, MMA waits) and its most sampled instructions; the page itself is
written beside the JSON (gzip). Needs ``ncu`` and a GPU whose counters it may read.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = "triton:S0-256,triton:S1-256,triton:S3-256,triton:S0-128,fa4:S0-256,fa4:S1-256,fa4:S0-128"
KERNELS = "regex:attn_fwd|flash_fwd"  # ours (attn_fwd, attn_fwd_gluon*) and FA4's
METRICS = {
    "kernel": "Kernel Name",
    "profiled_ms": "gpu__time_duration.sum",
    "tensor_pipe_active_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm_active_cycles": "sm__cycles_active.avg",
    "sm_elapsed_cycles": "sm__cycles_elapsed.avg",
    "instructions": "smsp__inst_executed.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "registers": "launch__registers_per_thread",
    "dynamic_smem_kb": "launch__shared_mem_per_block_dynamic",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "l2_busy_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "smem_busy_pct": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
    "dram_read_gb": "dram__bytes_read.sum",
}
# ncu picks a unit per column (us or ms, Mbyte or Gbyte): factors to the unit the key names.
TO = {"profiled_ms": {"ns": 1e-6, "us": 1e-3, "ms": 1.0},
      "dram_read_gb": {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0}}  # fmt: skip
SAMPLES = "smsp__pcsamp_sample_count"
STALL = "smsp__pcsamp_warps_issue_stalled_"


def parse_case(case: str) -> tuple[str, str, int]:
    """``fa4:S1-256`` -> ("fa4", "S1", 256): who, then a case of spanattn.bench.cases (no pages)."""
    from spanattn.bench.cases import parse_case as scenario_case

    who, _, rest = case.partition(":")
    if who not in ("triton", "fa4"):
        raise ValueError(f"--cases: {case!r} does not start with triton: or fa4:")
    sid, d, _ = scenario_case(rest, pages=False)
    return who, sid, d


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def summarize(raw_csv: str) -> list[dict]:
    """ncu's raw page (a header row, a units row, a row per profiled kernel) -> per kernel the
    METRICS and each warp-stall reason's share of the samples (``stalls``, largest first)."""
    rows = list(csv.reader(io.StringIO(raw_csv)))
    head, units = rows[0], dict(zip(rows[0], rows[1]))
    out = []
    for row in rows[2:]:
        val = dict(zip(head, row))
        rec = {key: _number(val[name]) for key, name in METRICS.items() if name in val}
        for key, factor in TO.items():
            if key in rec:
                rec[key] *= factor[units[METRICS[key]]]
        total = _number(val.get(SAMPLES, "0")) or 1
        stalls = {h[len(STALL):]: _number(v) / total for h, v in val.items()
                  if h.startswith(STALL) and not h.endswith("_not_issued")}  # fmt: skip
        shares = sorted(((k, round(v, 4)) for k, v in stalls.items() if v), key=lambda kv: -kv[1])
        rec["stalls"] = dict(shares)
        out.append(rec)
    return out


def _sass_kind(sass: str) -> str:
    """An instruction's kind for the sample ledger: barriers keep their operands (``BAR.SYNC
    ... 0x1`` is the CTA barrier, ``0x0, 0x80`` one warpgroup's), mbarrier waits are one kind
    whatever the barrier, the rest their opcode's first two parts (``HGMMA.64x64x16.F32.BF16`` ->
    ``HGMMA.64x64x16``)."""
    words = sass.replace(";", " ").split()
    if words and words[0].startswith("@"):
        words = words[1:]
    if not words:
        return "?"
    op = words[0]
    if op.startswith("BAR."):
        return " ".join(words)
    if op.startswith("SYNCS.PHASECHK"):
        return "SYNCS.PHASECHK (mbarrier wait)"
    return ".".join(op.split(".")[:2])


def _samples(text: str) -> float:
    value = _number(text)
    return value if isinstance(value, float) else 0.0


def _kernel_ledger(rows: list[dict], top: int) -> dict:
    """One kernel's rows of the source page -> its samples by kind and its hottest instructions."""
    head = list(rows[0]) if rows else []
    total_col = next((h for h in head if h.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        return {"samples": 0, "by_kind": {}, "top": []}
    sass = head[head.index("Address") + 1]  # the SASS text's column, right of its address
    # a column per reason (``stall_barrier``) beside its not-issued twin
    reasons = {h: h[6:] for h in head if h.startswith("stall_") and not h.endswith("(Not Issued)")}
    sampled = [(r, n) for r in rows if (n := _samples(r[total_col])) > 0]
    total = sum(n for _, n in sampled) or 1.0
    kinds: dict[str, float] = {}
    for r, n in sampled:
        kind = _sass_kind(r[sass])
        kinds[kind] = kinds.get(kind, 0.0) + n / total
    hot = []
    for r, n in sorted(sampled, key=lambda rn: -rn[1])[:top]:
        why = {name: round(_samples(r[h]) / n, 3) for h, name in reasons.items() if _samples(r[h]) > 0}
        hot.append(
            {"address": r["Address"], "sass": r[sass].strip(), "share": round(n / total, 4), "stalls": why}
        )
    by_kind = {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v >= 1e-3}
    return {"samples": int(total), "by_kind": by_kind, "top": hot}


def summarize_source(page_csv: str, top: int = 12) -> list[dict]:
    """ncu's source page (``--page source --print-source sass --csv``: per profiled kernel a header
    row naming ``Address`` and ``Source``, then a row per SASS instruction) -> per kernel, in
    profiling order, its warp-state samples by instruction kind (share of the kernel's samples,
    largest first) and the ``top`` most sampled instructions with their stall reasons' shares
    where the page lists reasons per instruction."""
    kernels, head = [], None
    for row in csv.reader(io.StringIO(page_csv)):
        if "Address" in row and "Source" in row:
            head = row
            kernels.append([])
        elif head is not None and len(row) == len(head):
            kernels[-1].append(dict(zip(head, row)))
    return [_kernel_ledger(rows, top) for rows in kernels]


def write_png(path: Path, rows: list[dict]) -> bool:
    """Bars of the tensor pipes' busy share per step, one colour per kernel. False without matplotlib."""
    from spanattn.bench.report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    steps = list(dict.fromkeys(r["case"].split(":")[1] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 * len(steps) + 2, 4))
    for j, who in enumerate(("triton", "fa4")):
        got = {
            r["case"].split(":")[1]: r["tensor_pipe_active_pct"] for r in rows if r["case"].startswith(who)
        }
        xs = [i + (j - 0.5) * 0.4 for i, step in enumerate(steps) if step in got]
        label = "triton backend" if who == "triton" else "FA4's built-in kernel (causal twin)"
        ax.bar(xs, [got[step] for step in steps if step in got], 0.4, label=label)
    ax.set_xticks(range(len(steps)), steps)
    ax.set_ylim(0, 100)
    ax.set_ylabel("tensor pipes busy, % of the launch")
    ax.set_title("Where the MMA time goes (Nsight Compute, one call per step)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _call(who: str, sid: str, d: int):
    """(the call, its allowed pairs) for one case on the GPU."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from short_walks import _builtin, _causal_twin, _inputs  # benchmarks/short_walks.py's steps

    import spanattn as sa
    from spanattn.bench.cases import named_scenarios

    sc = named_scenarios()[sid]
    p = sa.plan(*(_causal_twin(sc) if who == "fa4" else (sc.batch, sc.layer)), "cuda")
    q, k, v = _inputs(p, d, torch.bfloat16, seed=0)
    if who == "fa4":
        builtin = _builtin(d)
        if builtin is None:
            raise SystemExit(f"{sid}-{d}: FA4 is not installed here or stops short of head_dim {d}")
        return (lambda: builtin(q, k, v, p)), p.allowed_pairs()
    from spanattn.backends import triton as tb

    return (lambda: tb.forward(q, k, v, p, scale=d**-0.5)), p.allowed_pairs()


def child(cases: list[str]) -> None:
    """Inside ncu: warm every case up and time it, then profile one call of each in turn."""
    import torch

    calls, timed = [], []
    for case in cases:
        fn, pairs = _call(*parse_case(case))
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        calls.append(fn)
        timed.append({"case": case, "event_ms": start.elapsed_time(end) / 10, "allowed_pairs": pairs})
    torch.cuda.profiler.start()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("TIMED " + json.dumps(timed), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for <date>-kernel-counters-<gpu>.json")
    ap.add_argument("--cases", default=CASES, help="who:scenario-head_dim, ...")
    ap.add_argument(
        "--source", action="store_true", help="also where the warp samples sit, per SASS instruction"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the profiled process
    args = ap.parse_args()
    try:
        cases = args.cases.split(",")
        [parse_case(c) for c in cases]
    except ValueError as e:
        ap.error(str(e))
    if args.child:
        child(cases)
        return
    import torch

    if not args.out:
        ap.error("--out is needed")
    if not torch.cuda.is_available() or not shutil.which("ncu"):
        ap.error("profile_kernels.py reads a GPU's counters with ncu: no GPU or no ncu here")
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "prof"
        cmd = ["ncu", "--clock-control", "none", "--set", "full", "--import-source", "no",
               "--profile-from-start", "off", "-k", KERNELS, "-o", str(rep),
               sys.executable, __file__, "--child", "--cases", args.cases]  # fmt: skip
        print("profiling", ", ".join(cases), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        timed = [line for line in run.stdout.splitlines() if line.startswith("TIMED ")]
        if run.returncode or not timed:
            raise SystemExit(f"ncu failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        raw = subprocess.run(["ncu", "-i", f"{rep}.ncu-rep", "--page", "raw", "--csv"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        page = ""
        if args.source:
            got = subprocess.run(["ncu", "-i", f"{rep}.ncu-rep", "--page", "source", "--print-source", "sass",
                                  "--csv"], capture_output=True, text=True)  # fmt: skip
            page = got.stdout
            if got.returncode:
                print(f"ncu's source page failed (counters kept):\n{got.stderr[-2000:]}", flush=True)
    kernels = summarize(raw)
    if len(kernels) != len(cases):
        raise SystemExit(f"expected one profiled kernel per case, got {len(kernels)} for {len(cases)}")
    from spanattn.bench.report import environment, result_path

    rows = [{**t, **k} for t, k in zip(json.loads(timed[-1][6:]), kernels)]
    for r in rows:
        print(f"{r['case']:14} {r['event_ms']:8.3f} ms  tensor pipes {r['tensor_pipe_active_pct']:5.1f}%  "
              f"SMs active {100 * r['sm_active_cycles'] / r['sm_elapsed_cycles']:5.1f}%  "
              f"{r['instructions'] / 1e9:.2f} G instructions")  # fmt: skip
    env = environment("cuda")
    path = result_path(args.out, "kernel-counters", env)
    if page:
        import gzip

        sources = summarize_source(page)
        if len(sources) == len(rows):
            for r, src in zip(rows, sources):
                r["source"] = src
        else:
            print(
                f"the source page holds {len(sources)} kernels for {len(rows)} cases: not matched", flush=True
            )
        path.with_name(path.stem + "-sass.csv.gz").write_bytes(gzip.compress(page.encode()))
    path.write_text(json.dumps({**env, "cases": rows, "notes": __doc__}, indent=1) + "\n")
    print(
        f"wrote {path}"
        + (f" and {path.with_suffix('.png').name}" if write_png(path.with_suffix(".png"), rows) else "")
    )


if __name__ == "__main__":
    main()
