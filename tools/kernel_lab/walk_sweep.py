"""What a work item costs apart from its key tiles: the triton backend and FA4's built-in kernel
on steps whose items all walk the same number of keys, from a couple of key tiles to many.

    python tools/kernel_lab/walk_sweep.py --out results/ [--keys 256,512,1024,2048,4096,8192] [--d 128,256]

A step: bidirectional sequences (causal off) of ``min(1024, keys)`` queries over ``keys`` keys,
as many as hold about the same number of pairs at every length (bf16, Hq 16 / Hkv 8, random
inputs), so that only the items' count and walk length change. An item is a 128-query tile of
a head (both kernels' query tiles). Per length and contender: the step's time, one item's time
on one SM (step time x SMs / items), and triton's time over FA4's: where short walks cost
triton more than FA4 (loading Q, the first tile's softmax without a P @ V under it, the last
P @ V and the stores, handing over the next item), the ratio grows as walks shorten. Each
contender is checked first on a small step of the same kind (fresh inputs, NaN-poisoned
outputs); timing rounds alternate the contenders, medians over rounds. CUDA only. Writes
``<date>-walk-sweep-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

import spanattn as sa
from spanattn.bench.report import environment, result_path
from spanattn.bench.timing import rotated
from spanattn.oracle import Truth
from spanattn.scenarios import HKV, HQ

PAIRS = 1 << 27  # per head, about the same at every length


def step(keys: int, seqs: int | None = None, device: str = "cuda"):
    """The sweep's step at ``keys`` keys per item (``seqs`` sequences, else as many as hold
    about ``PAIRS`` pairs)."""
    q_len = min(1024, keys)
    n = seqs or max(1, PAIRS // (q_len * keys))
    seqs = [sa.Seq(q_len=q_len, kv_len=keys, causal=False)] * n
    return sa.plan(sa.Batch(seqs), sa.LayerMask(spans="off"), device)


def _inputs(p, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((p.total_q, HQ), (p.total_k, HKV), (p.total_k, HKV))
    return [torch.randn(n, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for n, h in shapes]


def contenders(d: int) -> dict:
    """name -> call(q, k, v, plan) -> out."""
    from spanattn.backends import triton as tb

    out = {"triton": lambda q, k, v, p: tb.forward(q, k, v, p, scale=d**-0.5)[0]}
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # optional peer: any import failure means "not here"
        return out
    out["fa4-builtin"] = lambda q, k, v, p: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
        max_seqlen_k=p.max_seqlen_k, softmax_scale=d**-0.5, causal=False)[0]  # fmt: skip
    return out


def _check(call, d) -> dict:
    p = step(512, seqs=3)
    q, k, v = _inputs(p, d, seed=1)
    torch.full((4 * q.numel(),), float("nan"), device="cuda")  # poison what the output will reuse
    verdict = Truth(q, k, v, p, scale=d**-0.5).check(call(q, k, v, p), rounding_slack=True)
    return {"ok": bool(verdict.ok), "err": verdict.err, "bound": verdict.bound}


def run(d: int, lengths: list[int], rounds: int) -> dict:
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    calls = contenders(d)
    out = {"d": d, "checks": {n: _check(c, d) for n, c in calls.items()}, "lengths": []}
    for keys in lengths:
        p = step(keys)
        q, k, v = _inputs(p, d, seed=0)
        q_lens = (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()
        items = sum((n + 127) // 128 for n in q_lens) * HQ
        for c in calls.values():  # compilation and tables outside the rounds
            c(q, k, v, p)
        times = {n: [] for n in calls}
        names = list(calls)
        args = (q, k, v, p)
        for r in range(rounds):
            for n in rotated(names, r):
                call = functools.partial(calls[n], *args)
                times[n].append(do_bench(call, warmup=5, rep=60, return_mode="median"))
        row = {"keys": keys, "sequences": len(q_lens), "items": items}
        row["ms"] = {n: statistics.median(t) for n, t in times.items()}
        row["item_sm_us"] = {n: ms * 1e3 * sms / items for n, ms in row["ms"].items()}
        if "fa4-builtin" in row["ms"]:
            row["triton_over_fa4"] = row["ms"]["triton"] / row["ms"]["fa4-builtin"]
        out["lengths"].append(row)
        ratio = f" | triton / fa4 {row['triton_over_fa4']:.3f}" if "triton_over_fa4" in row else ""
        print(f"d{d} keys {keys}:", ", ".join(f"{n} {ms:.3f} ms" for n, ms in row["ms"].items()) + ratio,
              flush=True)  # fmt: skip
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--keys", default="256,512,1024,2048,4096,8192", help="keys per item, comma-separated")
    ap.add_argument("--d", default="128,256", help="head dims")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    env = environment("cuda")
    lengths = [int(x) for x in args.keys.split(",")]
    runs = [run(int(d), lengths, args.rounds) for d in args.d.split(",")]
    res = {**env, "rounds": args.rounds, "runs": runs}
    res["notes"] = __doc__
    path = result_path(args.out, "walk-sweep", env)
    path.write_text(json.dumps(res, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
