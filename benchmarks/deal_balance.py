"""How evenly a persistent Gluon launch spreads a step's work over the GPU's SMs, worked out on
the CPU from the tile schedule: the programs' busiest total over a perfect split, for the deal
the kernels use (gluon_parts.work_item: work items dealt to the programs forward on even rounds,
backward on odd ones) and for a greedy deal (each item to the program that is free first, as
the hardware does with one program per item, or a work queue would).

    python benchmarks/deal_balance.py --out results/ [--sms 132] [--item-cost 2]

A work item is (query tile, head), heaviest first (the schedule's LPT order, heads fastest); its
cost in key tiles: those it walks plus ``--item-cost`` for its Q load, first and last tiles and
stores. A perfect split: the total over the programs, or the heaviest item if that is more. A
ratio of 1.03 means the launch's last program finishes 3% after a perfect one would: the most a
better deal could win. Writes ``<date>-deal-balance-<cpu>.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json

import torch

import spanattn as sa
from spanattn.backends.triton.configs import GLUON_CONFIGS
from spanattn.backends.triton.schedule import build_schedule
from spanattn.bench.cases import named_scenarios, parse_case
from spanattn.scenarios import HQ

CASES = ("S0-128", "S0-256", "S1-128", "S1-256", "S2-128", "S2-256", "S3-256", "S4-128", "S5-512")


def item_costs(sid: str, d: int, item_cost: float, scale: int = 1) -> torch.Tensor:
    """float64 ``[tiles * HQ]``: each work item's cost in key tiles, in launch order."""
    sc = named_scenarios(scale)[sid]
    cfg = GLUON_CONFIGS[d]
    sched = build_schedule(sa.plan(sc.batch, sc.layer, "cpu"), cfg.block_m, cfg.block_n)
    keys = (sched.column("kv_end") - sched.column("kv_start")).clamp_min(0).double()
    return (torch.ceil(keys / cfg.block_n) + item_cost).repeat_interleave(HQ)


def dealt(costs: list[float], programs: int) -> float:
    """The busiest program's total under gluon_parts.work_item's deal: item ``r * programs +
    lane`` goes to program ``lane`` on even rounds ``r`` and ``programs - 1 - lane`` on odd."""
    load = [0.0] * programs
    for i, c in enumerate(costs):
        r, lane = divmod(i, programs)
        load[lane if r % 2 == 0 else programs - 1 - lane] += c
    return max(load)


def greedy(costs: list[float], programs: int) -> float:
    """The busiest program's total when each item goes to the program free first."""
    free = [0.0] * programs
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def balance(costs: torch.Tensor, programs: int) -> dict:
    c = costs.tolist()
    bound = max(sum(c) / programs, max(c))
    return {
        "items": len(c),
        "items_per_program": len(c) / programs,
        "dealt_over_perfect": dealt(c, programs) / bound,
        "greedy_over_perfect": greedy(c, programs) / bound,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--sms", type=int, default=132, help="programs of a persistent launch (H200: 132)")
    ap.add_argument("--item-cost", type=float, default=2.0, help="key tiles' worth of work per item")
    ap.add_argument("--cases", default=",".join(CASES), help="scenario-head_dim, ...")
    ap.add_argument("--scale", type=int, default=1, help="divide token counts")
    args = ap.parse_args()
    from spanattn.bench.report import environment, result_path

    try:
        cases = {case: parse_case(case, pages=False) for case in args.cases.split(",")}
    except ValueError as e:
        ap.error(str(e))
    rows = {}
    for case, (sid, d, _) in cases.items():
        rows[case] = balance(item_costs(sid, d, args.item_cost, args.scale), args.sms)
        r = rows[case]
        print(f"{case}: {r['items']} items, {r['items_per_program']:.1f} per program, dealt "
              f"{r['dealt_over_perfect']:.4f}, greedy {r['greedy_over_perfect']:.4f} x perfect")  # fmt: skip
    env = environment("cpu")
    result = {**env, "sms": args.sms, "item_cost": args.item_cost, "scale": args.scale, "cases": rows,
              "notes": __doc__}  # fmt: skip
    path = result_path(args.out, "deal-balance", env)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
