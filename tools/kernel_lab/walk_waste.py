"""How much of what a kernel computes its mask keeps, worked out on the CPU from the tiles alone:
the share of the (query, key) pairs in the key tiles a kernel walks that the step allows, for the
Gluon kernels' tile tables on the step and for FA4's built-in kernel on the step's causal twin
(its causal/window block range), and their ratio: the per-pair efficiency (short_walks.py's
measure) that wasted pairs alone would give. Where it is near 1.0, both kernels waste alike and
a measured efficiency below it is each walked tile's speed, not the tiles. Also counted: the
key tiles the Gluon kernel's two consumer warpgroups (half of a query tile's rows each) would
walk if each walked only the tiles holding its own rows' keys, instead of its query tile's whole
walk (FA4's two consumer warpgroups also walk their tile's whole range), and the efficiency
wasted pairs alone would then give.

    python tools/kernel_lab/walk_waste.py --out results/ [--cases S1-256,S3-256] [--scale 1]

A tile's pairs count whole: all its query rows (a sequence's last tile too) times all its keys.
Writes ``<date>-walk-waste-<cpu>.json``.
"""

from __future__ import annotations

import argparse
import json

import torch

import spanattn as sa
from spanattn.backends.triton.configs import GLUON_CONFIGS
from spanattn.backends.triton.schedule import build_schedule
from spanattn.bench.cases import named_scenarios, packed_cases

CASES = ("S0-128", "S0-256", "S1-128", "S1-256", "S2-128", "S2-256", "S3-256", "S4-128")
# FA4's tiles on Hopper (its SM90 forward's choice, flash-attn-4 as tools/fa4_bundle.sh pins it):
# 128 query rows; key tiles per head_dim, without and with a window.
FA4_TILE_M = 128
FA4_TILE_N = {128: (128, 128), 256: (80, 64)}


def ours(batch: sa.Batch, layer: sa.LayerMask, d: int) -> dict:
    """Allowed and walked pairs per head of the Gluon kernel for ``d`` on the step."""
    cfg = GLUON_CONFIGS[d]
    plan = sa.plan(batch, layer, "cpu")
    sched = build_schedule(plan, cfg.block_m, cfg.block_n)
    key_tiles = int(sched.key_tiles().sum())
    rows = cfg.block_m // 2  # a consumer warpgroup's
    return {
        "allowed": plan.allowed_pairs(),
        "walked": key_tiles * cfg.block_m * cfg.block_n,
        "key_tiles_per_query_tile": key_tiles / sched.num_tiles,
        "walked_by_own_rows": consumer_tiles(plan, cfg.block_m, cfg.block_n) * rows * cfg.block_n,
    }


def consumer_tiles(plan, block_m: int, block_n: int) -> int:
    """Key tiles walked if each half of a ``block_m``-row query tile walked only the tiles from
    the one holding its rows' smallest ``lo`` to the one holding their largest ``hi`` (a half
    with no row of the sequence copies its last row's interval, as the kernel's rows past the
    end do). Intervals only: a plan with span groups walks more (group_walk.py)."""
    lo, hi = plan.lo.tolist(), plan.hi.tolist()
    cu = plan.cu_seqlens_q.tolist()
    tiles = 0
    for a, b in zip(cu[:-1], cu[1:]):
        for r0 in range(a, b, block_m // 2):
            r1 = min(r0 + block_m // 2, b)
            tiles += max(hi[r0:r1]) // block_n - min(lo[r0:r1]) // block_n + 1
        if -(-(b - a) // (block_m // 2)) % 2:  # the last tile's second half: past the end
            tiles += hi[b - 1] // block_n - lo[b - 1] // block_n + 1
    return tiles


def fa4_twin(lengths: list[tuple[int, int]], window: int | None, d: int) -> dict:
    """Allowed and walked pairs per head of FA4's built-in kernel on causal sequences of
    ``(q_len, kv_len)`` (the queries the last ones), with ``window`` keys up to each query's own.
    A query tile walks the key tiles from the one holding its first row's first key to the one
    holding its last row's last key."""
    tile_n = FA4_TILE_N[d][window is not None]
    allowed = walked = 0
    for q_len, kv_len in lengths:
        last = torch.arange(q_len) + kv_len - q_len  # each query's last key
        first = (last - window + 1).clamp_min(0) if window else torch.zeros_like(last)
        allowed += int((last - first + 1).sum())
        for m0 in range(0, q_len, FA4_TILE_M):
            m1 = min(m0 + FA4_TILE_M, q_len) - 1
            n_end = -(-(int(last[m1]) + 1) // tile_n)
            walked += (n_end - int(first[m0]) // tile_n) * FA4_TILE_M * tile_n
    return {"allowed": allowed, "walked": walked}


def case_row(sid: str, d: int, scale: int = 1) -> dict:
    sc = named_scenarios(scale)[sid]
    mine = ours(sc.batch, sc.layer, d)
    twin = fa4_twin([(s.q_len, s.kv_len) for s in sc.batch.seqs], sc.layer.window, d)
    mine["useful"] = mine["allowed"] / mine["walked"]
    mine["useful_own_rows"] = mine["allowed"] / mine["walked_by_own_rows"]
    twin["useful"] = twin["allowed"] / twin["walked"]
    return {
        "triton": mine,
        "fa4_builtin_twin": twin,
        "waste_only_efficiency": mine["useful"] / twin["useful"],
        "waste_only_efficiency_own_rows": mine["useful_own_rows"] / twin["useful"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--cases", default=",".join(CASES), help="scenario-head_dim, ... (head_dim 128 or 256)")
    ap.add_argument("--scale", type=int, default=1, help="divide token counts")
    args = ap.parse_args()
    from spanattn.bench.report import environment, result_path

    cases = packed_cases(ap, args.cases)
    if bad := [case for case, (_, d) in cases.items() if d not in FA4_TILE_N]:
        ap.error(f"--cases: {', '.join(bad)}: FA4's built-in kernel runs head_dim 128 and 256 here")
    rows = {}
    for case, (sid, d) in cases.items():
        rows[case] = r = case_row(sid, d, args.scale)
        mine, twin = r["triton"], r["fa4_builtin_twin"]
        print(f"{case}: triton {mine['useful']:.3f} of walked pairs allowed "
              f"({mine['key_tiles_per_query_tile']:.1f} key tiles per query tile), FA4 twin "
              f"{twin['useful']:.3f}: waste alone {r['waste_only_efficiency']:.3f}; consumers walking "
              f"their own rows' tiles {mine['useful_own_rows']:.3f}: "
              f"{r['waste_only_efficiency_own_rows']:.3f}")  # fmt: skip
    env = environment("cpu")
    result = {**env, "scale": args.scale, "fa4_tiles": {"m": FA4_TILE_M, "n": FA4_TILE_N}, "cases": rows,
              "notes": __doc__}  # fmt: skip
    path = result_path(args.out, "walk-waste", env)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
