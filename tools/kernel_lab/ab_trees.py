"""Source trees of spanattn timed against each other on the standard scenarios, for a kernel
change (write down what it should move first): each tree in a process of its own (two trees'
kernels cannot share one), the trees taking turns round by round, so that a slow stretch of
the machine falls on all of them alike.

    git archive main spanattn | tar -x -C /tmp/main
    python tools/kernel_lab/ab_trees.py --out results/ --trees main=/tmp/main new=. \\
        --cases S0-256,S1-128,S3-256 --rounds 3

A tree is a folder holding a ``spanattn`` package. The trees' order rotates by one each round
(``round_order``): the tree that runs first in a round can run 1-2% faster on code identical to
the others' (seen on the H200), and a fixed order would give that to one tree every round. Per
tree, round and case: the triton backend's forward on the scenario (S0-S5, or the span-group
steps V1/V2) at full size (bf16, Hq 16 / Hkv 8, random inputs; a case ending in ``-p16``: K/V
scattered over a cache of 16-token pages, called through ``spanattn.attention`` as a serving
step would, its block-table check included), the least of three ``triton.testing.do_bench``
medians of 100 ms each. CUDA only: it times kernels, not correctness (the tree's tests and
short_walks.py check that). Writes ``<date>-ab-trees-<gpu>.json``: every round's times, per
case the median over rounds and each tree's time over the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def time_cases(cases: list[str]) -> dict:
    """ms per case (``S3-256``: scenario and head_dim) in this process's spanattn."""
    import torch
    from triton.testing import do_bench

    import spanattn as sa
    from spanattn.backends import triton as tb
    from spanattn.bench.cases import named_scenarios, parse_case
    from spanattn.scenarios import HKV, HQ

    def call(case: str):
        sid, d, page = parse_case(case)
        sc = named_scenarios()[sid]
        p = sa.plan(sc.batch, sc.layer, "cuda")
        shapes = ((p.total_q, HQ), (p.total_k, HKV), (p.total_k, HKV))
        q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16) for n, h in shapes)
        if page:
            from gpu_paged_prefill import paged_copy  # this script's folder

            kc, vc, table = paged_copy(k, v, p, page, torch.Generator().manual_seed(0))
            return lambda: sa.attention(q, kc, vc, p, block_table=table, backend="triton", scale=d**-0.5)
        return lambda: tb.forward(q, k, v, p, scale=d**-0.5)

    out = {}
    for case in cases:
        run = call(case)
        run()
        torch.cuda.synchronize()
        out[case] = min(do_bench(run, warmup=5, rep=100, return_mode="median") for _ in range(3))
    return out


def run_tree(path: str, cases: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
    cmd = [sys.executable, __file__, "--time", ",".join(cases)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def round_order(trees: list[str], r: int) -> list[str]:
    """The trees' order in round ``r``: the list rotated by ``r``.

    >>> round_order(["a", "b", "c"], 1)
    ['b', 'c', 'a']
    """
    k = r % len(trees)
    return trees[k:] + trees[:k]


def summary(rounds: list[dict], trees: list[str], cases: list[str]) -> dict:
    """Per case: each tree's median over rounds, and its ratio to the first tree's (below 1:
    faster)."""
    out = {}
    for case in cases:
        med = {t: statistics.median(r[t][case] for r in rounds) for t in trees}
        out[case] = {"ms": med, "vs_first": {t: med[t] / med[trees[0]] for t in trees}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for <date>-ab-trees-<gpu>.json")
    ap.add_argument("--trees", nargs="+", default=[], help="name=folder holding a spanattn package")
    ap.add_argument("--cases", default="S0-256,S1-128,S1-256,S3-256,S4-128", help="scenario-head_dim, ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time", help=argparse.SUPPRESS)  # a tree's own process: print its times
    args = ap.parse_args()
    if args.time:
        print(json.dumps(time_cases(args.time.split(","))), flush=True)
        return
    if not args.out or len(args.trees) < 2:
        ap.error("--out and at least two --trees are needed")
    from spanattn.bench.cases import parse_case

    cases = args.cases.split(",")
    try:
        [parse_case(c) for c in cases]
    except ValueError as e:
        ap.error(str(e))
    import torch

    if not torch.cuda.is_available():
        ap.error("ab_trees.py times CUDA kernels: no GPU here")
    from spanattn.bench.report import environment, result_path

    trees = dict(t.split("=", 1) for t in args.trees)
    rounds = []
    for r in range(args.rounds):
        times = {name: run_tree(trees[name], cases) for name in round_order(list(trees), r)}
        rounds.append({name: times[name] for name in trees})
        line = (
            f"{name} " + " ".join(f"{c} {ms:.3f}" for c, ms in t.items()) for name, t in rounds[-1].items()
        )
        print(f"round {r + 1}/{args.rounds}: " + " | ".join(line), flush=True)
    env = environment("cuda")
    result = {**env, "trees": trees, "cases": cases, "rounds": rounds,
              "summary": summary(rounds, list(trees), cases), "notes": __doc__}  # fmt: skip
    path = result_path(args.out, "ab-trees", env)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
