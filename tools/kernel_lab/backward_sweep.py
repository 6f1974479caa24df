"""Which tiles should the backward kernels use? Candidate (dK/dV, dQ) configs timed on training
scenarios, one kernel varied at a time (the other at its shipped config), each candidate's
gradients held to the shipped config's first.

    python tools/kernel_lab/backward_sweep.py --out results/   # GPU: T0 and T1 at d128 and d256, T5 at d512
    python tools/kernel_lab/backward_sweep.py --cases T1-256 --out results/
    TRITON_INTERPRET=1 python tools/kernel_lab/backward_sweep.py --tiny --out /tmp/x  # CPU smoke run

A config is BLOCK_M,BLOCK_N,num_warps,num_stages[,dv_split]: for dK/dV, BLOCK_N keys per
program and BLOCK_M queries per step of its walk; for dQ, BLOCK_M queries per program and
BLOCK_N keys per step. Candidates that do not fit (shared memory, registers) are recorded with
their error. Time: the whole backward (preprocess, dK/dV, dQ) of one forward, median of
triton.testing.do_bench; rate ``10 * D * Hq * allowed pairs / time``. Check: each candidate's dq,
dk, dv against the shipped config's, max error over max magnitude (both accumulate in fp32;
only the summation order differs), at most 2e-2 in bf16. Compile-stat filtering first:
compile_stats_backward.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from short_walks import _inputs, _time_ms  # noqa: E402

import spanattn as sa  # noqa: E402
from spanattn.backends.triton.configs import Config, pick_backward  # noqa: E402
from spanattn.backends.triton.gradients import backward  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.scenarios import HQ, training_scenarios  # noqa: E402

C = Config
# Candidates whose ptxas report (compile_stats_backward.py, triton 3.9, sm_90, bf16) spills at most
# ~0.5 KB, most through wgmma. The shipped d256 dK/dV tiles (32 keys a program) compile to mma.sync:
# a warpgroup's wgmma needs 64 rows, and the keys are the rows of K Q^T. Holding dK, dV [keys, D]
# in fp32 plus K, V is what fills the registers, hence the column splits (dv_split) at d256.
CANDIDATES = {  # head_dim -> (dK/dV candidates, dQ candidates); the shipped ones are added
    128: (
        [C(16, 128, 8, 3), C(64, 128, 8, 2), C(32, 64, 4, 2), C(64, 128, 8, 1), C(32, 128, 8, 3)],
        [C(128, 64, 8, 2), C(64, 64, 4, 3), C(128, 32, 4, 3), C(64, 32, 4, 2), C(128, 64, 8, 1),
         C(64, 128, 8, 2)],
    ),
    256: (
        [C(16, 128, 8, 2, dv_split=2), C(32, 128, 8, 1, dv_split=2), C(32, 128, 8, 2, dv_split=2),
         C(16, 64, 8, 2), C(64, 32, 8, 1), C(16, 64, 4, 2, dv_split=2)],
        [C(128, 64, 8, 1, dv_split=2), C(64, 16, 4, 3), C(128, 32, 8, 1), C(64, 64, 8, 1)],
    ),
    # d512: K and V [keys, 512] held in registers for the whole walk are what spills (even with
    # dK/dV split 8 ways); the fitting wgmma dQ tiles, the least-spilling dK/dV ones
    512: (
        [C(16, 64, 4, 1, dv_split=8), C(16, 64, 4, 2, dv_split=8), C(16, 32, 4, 1, dv_split=4)],
        [C(64, 32, 4, 1, dv_split=4), C(64, 16, 4, 2, dv_split=2)],
    ),
    16: ([C(16, 16, 4, 1)], [C(16, 16, 4, 1)]),  # --tiny
}  # fmt: skip


def tiles(c: Config) -> str:
    return f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages},{c.dv_split}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def sweep_case(sid: str, d: int, scale: int, device: str, dtype, log) -> list[dict]:
    sc = training_scenarios(scale)[sid]
    p = sa.plan(sc.batch, sc.layer, device)
    q, k, v = _inputs(p, d, dtype, seed=0)
    out, lse = sa.attention(q, k, v, p, backend="triton", return_lse=True)
    dout = torch.randn_like(q)
    pairs, shipped = p.allowed_pairs(), pick_backward(d, dtype, not q.is_cuda)
    run = lambda cfg: backward(q, k, v, out, lse, dout, p, scale=d**-0.5, config=cfg)
    want = run(shipped)
    dkdv, dq = CANDIDATES[d]
    tries = [("shipped", shipped), *(("dkdv", (c, shipped[1])) for c in dkdv)]
    tries += [("dq", (shipped[0], c)) for c in dq]
    rows = []
    for part, cfg in tries:
        row = {"scenario": sid, "d": d, "varied": part, "dkdv": tiles(cfg[0]), "dq": tiles(cfg[1])}
        try:
            row["err"] = max(rel(a, b) for a, b in zip(run(cfg), want))
            row["ok"] = row["err"] <= 2e-2
            row["ms"] = _time_ms(lambda c=cfg: run(c), device, 10)
            row["tflops"] = 10 * d * HQ * pairs / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # a candidate that does not fit
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        log(json.dumps(row))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for <date>-backward-sweep-<gpu>.json")
    ap.add_argument("--cases", default="T0-128,T1-128,T0-256,T1-256,T5-512",
                    help="training scenario and head_dim pairs (spanattn.scenarios)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1: d16, T1 / 64")
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float16 if args.tiny else torch.bfloat16
    pairs = [c.split("-") for c in args.cases.split(",")]
    cases = [("T1", 16)] if args.tiny else [(sid, int(d)) for sid, d in pairs]
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    rows = [r for sid, d in cases for r in sweep_case(sid, d, 64 if args.tiny else 1, device, dtype, log)]
    env = environment(device)
    res = {**env, "what": "backward tile candidates, one kernel varied at a time", "rows": rows}
    path = result_path(args.out, "backward-sweep", env)
    path.write_text(json.dumps(res, indent=1) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
