"""What the default block-table check costs a decode step, on one GPU in one call.

    python benchmarks/gpu_page_check.py --out results/ [--rounds 5] [--steps 20]

``sa.attention(..., block_table=...)`` checks, once per plan and block-table contents, that every
block a sequence reads exists (spanattn/cache.py ``checked_once``): a small device reduction and
one host sync. Here an eager decode loop runs as an engine's would: per step the block table is
copied in from pinned host memory (a new version of it), a plan is built for the step, ``layers``
attention calls of one layer kind read the paged cache (triton backend), and the step ends with a
sync (where an engine reads its sampled tokens). Per batch size and layer count, steps with the
check on and off alternate by round; medians. The step holds attention only (no projections, no
MLP), so the check's share of a real model's step is smaller than the ``share`` given here.
Also timed alone: ``check_block_table`` on the step's table, synchronized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import spanattn as sa
from spanattn.bench.report import environment, result_path
from spanattn.cache import check_block_table, to_paged
from spanattn.scenarios import HKV, HQ

DEV = "cuda"
PAGE = 16


def _setup(batch: int, kv_len: int, head_dim: int):
    seqs = [sa.Seq(q_len=1, kv_len=kv_len) for _ in range(batch)]
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=DEV)
    k, v = (torch.randn(batch * kv_len, HKV, head_dim, device=DEV, dtype=torch.bfloat16) for _ in "kv")
    kc, vc, bt = to_paged(k, v, plan, PAGE)
    q = torch.randn(batch, HQ, head_dim, device=DEV, dtype=torch.bfloat16)
    return seqs, q, kc, vc, bt


def _step_ms(seqs, q, kc, vc, bt, host_bt, layers: int, check: bool, steps: int) -> float:
    """Median wall time of ``steps`` engine steps, each ending in a sync."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        bt.copy_(host_bt, non_blocking=True)  # the engine's per-step table upload: a new version
        plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=DEV)
        for _ in range(layers):
            sa.attention(q, kc, vc, plan, block_table=bt, backend="triton", check_pages=check)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(batch: int, kv_len: int, head_dim: int, layers: int, rounds: int, steps: int) -> dict:
    seqs, q, kc, vc, bt = _setup(batch, kv_len, head_dim)
    host_bt = bt.cpu().pin_memory()
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=DEV)
    for check in (True, False):  # compile and warm both paths
        _step_ms(seqs, q, kc, vc, bt, host_bt, layers, check, 2)
    on, off = [], []
    for _ in range(rounds):
        on.append(_step_ms(seqs, q, kc, vc, bt, host_bt, layers, True, steps))
        off.append(_step_ms(seqs, q, kc, vc, bt, host_bt, layers, False, steps))
    alone = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        check_block_table(bt, plan, kc.shape[0], PAGE)
        alone.append((time.perf_counter() - t0) * 1e3)
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    return {
        "batch": batch, "kv_len": kv_len, "head_dim": head_dim, "layers": layers,
        "step_ms_check": round(on_ms, 4), "step_ms_no_check": round(off_ms, 4),
        "check_ms": round(on_ms - off_ms, 4), "share": round((on_ms - off_ms) / off_ms, 4),
        "check_alone_ms": round(statistics.median(alone), 4),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for <date>-page-check-<gpu>.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    env = environment(DEV)
    rows = []
    for batch, kv_len in ((8, 4096), (64, 4096), (256, 2048)):
        for layers in (1, 26):
            row = run(batch, kv_len, 128, layers, args.rounds, args.steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = result_path(args.out, "page-check", env)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
