"""transformers' tensor parallelism on spanattn: the same stack on one GPU and on two, spanattn vs SDPA.

    python benchmarks/gpu_tensor_parallel.py --out results/          # 2 GPUs: 8k and 32k, bf16
    python benchmarks/gpu_tensor_parallel.py --tiny --out /tmp/tp    # CPU (gloo): toy sizes, fp32

Stacks: Gemma 3 and Gemma 4 as benchmarks/hf_families.py builds them (their released text
stacks' layer sizes, 6 layers, random weights, images marked by their token types), saved once,
then loaded by ``torchrun --nproc-per-node N`` workers of this script: N = 1 on one device, N = 2
with ``from_pretrained(..., tp_plan="auto")`` (each rank holds half of the query and KV heads; the
plan is built on every rank from the same token types). Per stack, world size and attention
(``attn_implementation="spanattn"``, or transformers' SDPA with its dense masks): median prefill
time and rank 0's peak memory above the weights.

Exactness, same call, at the first size in fp32 and in bf16: tensor parallelism changes the
order of the reductions, so two ranks never give one rank's bits; spanattn's two-rank hidden
states must stay as close to its one-rank ones as SDPA's do (at most twice SDPA's difference,
plus 1e-5 in fp32, 1e-2 in bf16), and equal SDPA's within the same rule at two ranks. A stack
that transformers' own SDPA cannot run tensor-parallel is reported with transformers' error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_families as hff  # noqa: E402

import spanattn.hf  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402

IMPLS = ("sdpa", spanattn.hf.NAME)
BUDGET = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def worker(args) -> None:
    """One rank: load the saved stack (tensor-parallel when WORLD_SIZE > 1), time both attentions
    at every size in bf16 (fp32 with --tiny), keep hidden states at the first size in each dtype."""
    import transformers

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    family = next(f for f in hff.FAMILIES if f.needs == args.family)
    out = {"world": world, "rows": [], "hidden": {}}
    dtypes = [torch.float32] if args.tiny else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        tp = {"tp_plan": "auto"} if world > 1 else {}
        cls = getattr(transformers, family.model)
        model = cls.from_pretrained(args.worker, dtype=dtype, **tp).eval()
        if world == 1:
            model = model.to(device)
        spanattn.hf.enable(model)
        sizes = args.sizes if dtype == dtypes[-1] else args.sizes[:1]
        for n in sizes:
            for impl in IMPLS:
                try:
                    res = hff.run(family, model, n, impl, device, args.tiny, args.warmup, args.repeats)
                except Exception as err:  # transformers' tensor-parallel forward failing: reported
                    res = {"status": "failed", "reason": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
                hidden = res.pop("hidden", None)
                if n == args.sizes[0] and hidden is not None:
                    out["hidden"][f"{impl} {str(dtype)[6:]}"] = hidden
                if dtype == dtypes[-1]:
                    out["rows"].append({"tokens": n, "impl": impl, **res})
                if rank == 0:
                    print(f"  world {world} {str(dtype)[6:]:8s} {n:6d} {impl:9s} {res}", flush=True)
        del model
    if rank == 0:
        torch.save(out, args.result)
    if torch.distributed.is_initialized():  # a clean exit: gloo aborts a process left mid-group
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(args, model_dir: Path, result: Path, world: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += [__file__, "--worker", str(model_dir), "--result", str(result), "--family", args.family_now]
    cmd += ["--sizes", *map(str, args.sizes), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    cmd += ["--tiny"] if args.tiny else []
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def exactness(one: dict, two: dict) -> dict:
    """Per dtype: each attention's two-rank vs one-rank difference, spanattn vs SDPA at two ranks."""
    checks = {}
    for dtype, budget in BUDGET.items():
        tag = str(dtype)[6:]
        keys = [f"{impl} {tag}" for impl in IMPLS]
        if not all(k in one["hidden"] and k in two["hidden"] for k in keys):
            continue
        sdpa, ours = keys
        tp_sdpa = hff.rel(two["hidden"][sdpa], one["hidden"][sdpa])
        tp_ours = hff.rel(two["hidden"][ours], one["hidden"][ours])
        vs_sdpa = hff.rel(two["hidden"][ours], two["hidden"][sdpa])
        one_vs_sdpa = hff.rel(one["hidden"][ours], one["hidden"][sdpa])
        ok = tp_ours <= 2 * tp_sdpa + budget and vs_sdpa <= 2 * one_vs_sdpa + budget
        checks[tag] = {
            "two_vs_one_rank_sdpa": tp_sdpa,
            "two_vs_one_rank_spanattn": tp_ours,
            "spanattn_vs_sdpa_one_rank": one_vs_sdpa,
            "spanattn_vs_sdpa_two_ranks": vs_sdpa,
            "ok": ok,
        }
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for <date>-tensor-parallel-<gpu>.json")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU in fp32, gloo (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="*", help="prompt lengths (default 8192 32768; tiny 128)")
    ap.add_argument("--families", default="gemma3,gemma4", help="comma-separated subset of gemma3,gemma4")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # the saved model, in a torchrun worker
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--family", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ([128] if args.tiny else [8192, 32768])
    if args.worker:
        worker(args)
        return 0
    if not args.out:
        ap.error("--out is required")
    import transformers

    cuda = torch.cuda.is_available() and not args.tiny
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("tensor parallelism over two GPUs needs two: this machine has one")
    device = torch.device("cuda" if cuda else "cpu")
    report = {
        "what": "prefill with images, one device vs two tensor-parallel ranks: spanattn.hf vs SDPA",
        **environment(device),
        "transformers": transformers.__version__,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "timing": f"median of {args.repeats} after {args.warmup} warm-up, rank 0, use_cache=True",
        "results": [],
        "exactness": {},
        "failed": {},
    }
    started = time.perf_counter()
    for name in args.families.split(","):
        family = next(f for f in hff.FAMILIES if f.needs == name)
        print(f"{family.name} ({family.source})", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, args.family_now = Path(tmp) / "model", name
            model = hff.build(family, args.tiny, device, torch.bfloat16)
            model.save_pretrained(model_dir)
            del model  # the workers need the memory
            if cuda:
                torch.cuda.empty_cache()
            runs = {}
            for world in (1, 2):
                result = Path(tmp) / f"world{world}.pt"
                done = launch(args, model_dir, result, world)
                print(done.stdout, end="", flush=True)
                if done.returncode != 0 or not result.exists():
                    lines = [x for x in done.stderr.splitlines() if "Error" in x and "ChildFailed" not in x]
                    report["failed"][f"{family.name}, {world} rank(s)"] = (lines or [done.stderr[-300:]])[-1]
                    continue
                runs[world] = torch.load(result)
                for row in runs[world]["rows"]:
                    report["results"].append({"family": family.name, "ranks": world, **row})
            if len(runs) == 2:
                report["exactness"][family.name] = exactness(runs[1], runs[2])
                print(f"  exactness: {report['exactness'][family.name]}", flush=True)
    report["seconds"] = time.perf_counter() - started
    path = result_path(args.out, "tensor-parallel", report)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} in {report['seconds']:.0f} s", flush=True)
    checks = [c["ok"] for fam in report["exactness"].values() for c in fam.values()]
    return 0 if checks and all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
