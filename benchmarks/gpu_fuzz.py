"""Random steps on the GPU against the fp64 truth, isolation checked on a sample (spanattn.bench.fuzz).

    python benchmarks/gpu_fuzz.py --backends triton,sdpa,reference --steps 1000 --out results/
    python benchmarks/gpu_fuzz.py --backends fa4,flex --steps 1000 --out results/

Lengths up to --max-tokens keys per step, head_dim 64-512 (each backend where it runs), GQA
1/2/4/8, windows 1..N, all span modes, causal and non-causal rows, packed and paged K/V, bf16 and
fp16, softcap. Writes <date>-fuzz-<backends>-<gpu>.json: the seed, per backend the steps run, passed and
skipped, the worst err/bound ratio, isolation checks and every failure with its step.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from spanattn.bench.fuzz import MODELS_GPU, fuzz
from spanattn.bench.report import environment, result_path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="triton,sdpa,reference")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=10000)
    ap.add_argument("--max-seconds", type=float, default=None, help="stop early (the JSON says how many ran)")
    ap.add_argument("--out", required=True, help="folder for the JSON")
    args = ap.parse_args()
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    backends = args.backends.split(",")
    tallies = fuzz(args.steps, args.seed, "cuda", backends, MODELS_GPU, args.max_tokens, log=log,
                   max_seconds=args.max_seconds)  # fmt: skip
    res = {**environment("cuda"), "seed": args.seed, "steps": args.steps, "max_tokens": args.max_tokens}
    res |= {"seconds": round(time.time() - t0, 1), "backends": {n: asdict(t) for n, t in tallies.items()}}
    try:
        import flash_attn

        res["flash_attn_4"] = getattr(flash_attn, "__version__", "?")
    except ImportError:
        pass
    path = result_path(args.out, f"fuzz-{'-'.join(backends)}", res)
    path.write_text(json.dumps(res, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
