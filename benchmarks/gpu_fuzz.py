"""Random steps on the GPU against the fp64 truth, isolation checked on a sample (spanattn.bench.fuzz).

    python benchmarks/gpu_fuzz.py --backends triton,sdpa,reference --steps 1000 --out results/
    python benchmarks/gpu_fuzz.py --backends fa4,flex --steps 1000 --out results/
    python benchmarks/gpu_fuzz.py --backends triton --steps 500 --first 500 --out results/  # the second half
    python benchmarks/gpu_fuzz.py --backends triton --steps 1000 --workers 3 --out results/

``--workers N``: the steps in N slices of the seed's cases, each in a process of its own on the
same GPU, their tallies added up (the same cases and results as one process: only faster, most
of a fresh machine's time being the first compiles of the many kernel variants, which the
processes share through triton's cache). Each process holds its own steps' fp64 truth, up to ~36 GB at
10k keys: three fit beside each other on a 141 GB GPU, eight do not.

Lengths up to --max-tokens keys per step, head_dim 64-512 (each backend where it runs), GQA
1/2/4/8, windows 1..N, all span modes, causal and non-causal rows, packed and paged K/V, bf16 and
fp16, softcap. Writes <date>-fuzz-<backends>-<gpu>.json: the seed, per backend the steps run, passed and
skipped, the worst err/bound ratio, isolation checks and every failure with its step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

from spanattn.bench.fuzz import MODELS_GPU, fuzz, merge, summary
from spanattn.bench.report import environment, result_path


def run_slice(worker: int, first: int, steps: int, seed: int, backends: list[str], max_tokens: int,
              max_seconds: float | None) -> dict:  # fmt: skip
    """Cases ``first ...`` of the seed in this process (a worker's slice)."""
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] worker {worker}: {msg}", flush=True)
    return fuzz(steps, seed, "cuda", backends, MODELS_GPU, max_tokens, log=log, max_seconds=max_seconds,
                first=first)  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="triton,sdpa,reference")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=10000)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop early (the JSON says how many ran)")
    ap.add_argument("--first", type=int, default=0, help="the seed's first case to run (N steps from 0, then "
                    "from N: one run of 2N)")  # fmt: skip
    ap.add_argument(
        "--workers", type=int, default=1, help="processes sharing the GPU, each a slice of the steps"
    )
    ap.add_argument("--out", required=True, help="folder for the JSON")
    args = ap.parse_args()
    t0 = time.time()
    backends = args.backends.split(",")
    bounds = [args.first + args.steps * w // args.workers for w in range(args.workers + 1)]
    slices = [(w, a, b - a, args.seed, backends, args.max_tokens, args.max_seconds)
              for w, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]  # fmt: skip
    if len(slices) == 1:
        tallies = run_slice(*slices[0])
    else:  # spawned: a forked child cannot use the parent's CUDA
        with ProcessPoolExecutor(len(slices), mp_context=multiprocessing.get_context("spawn")) as pool:
            tallies = merge(list(pool.map(run_slice, *zip(*slices))))
    res = {**environment("cuda"), "seed": args.seed, "first": args.first, "steps": args.steps,
           "workers": len(slices), "max_tokens": args.max_tokens}  # fmt: skip
    res |= {"seconds": round(time.time() - t0, 1), "backends": {n: asdict(t) for n, t in tallies.items()}}
    try:
        import flash_attn

        res["flash_attn_4"] = getattr(flash_attn, "__version__", "?")
    except ImportError:
        pass
    path = result_path(args.out, f"fuzz-{'-'.join(backends)}", res)
    path.write_text(json.dumps(res, indent=1))
    print(f"[{time.time() - t0:6.1f}s] {summary(tallies)}; wrote {path}", flush=True)


if __name__ == "__main__":
    main()
