"""Random steps with gradients on the GPU against the fp64 truth, the repeat and isolation checked
on a sample (spanattn.bench.grad_fuzz).

    python benchmarks/gpu_grad_fuzz.py --backends triton,sdpa,reference,flex,fa4 --steps 300 --out results/

Lengths up to --max-tokens keys per step (the fp64 truth's autograd holds a few [Hq, q, kv]
tensors per sequence), head_dim 64-512 (each backend where it trains), GQA 1/2/4/8, windows
1..N, all span modes and span groups, causal and non-causal rows, bf16 and fp16, softcap; a
random output gradient and LSE gradient. Writes <date>-grad-fuzz-<backends>-<gpu>.json: the
seed, per backend the steps run, passed and skipped, the worst err/bound ratio, repeat and
isolation checks and every failure with its step.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from spanattn.bench.grad_fuzz import MODELS_GPU, grad_fuzz
from spanattn.bench.report import environment, result_path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="triton,sdpa,reference")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop early (the JSON says how many ran)")
    ap.add_argument("--out", required=True, help="folder for the JSON")
    args = ap.parse_args()
    t0 = time.time()
    backends = args.backends.split(",")
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    tallies = grad_fuzz(args.steps, args.seed, "cuda", backends, MODELS_GPU, args.max_tokens, log=log,
                        max_seconds=args.max_seconds)  # fmt: skip
    res = {**environment("cuda"), "seed": args.seed, "steps": args.steps, "max_tokens": args.max_tokens}
    res |= {"seconds": round(time.time() - t0, 1), "backends": {n: asdict(t) for n, t in tallies.items()}}
    path = result_path(args.out, f"grad-fuzz-seed{args.seed}-{'-'.join(backends)}", res)
    path.write_text(json.dumps(res, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
