"""How evenly a persistent Gluon launch spreads a step's work over the GPU's SMs, worked out on
the CPU from the tile schedule: the programs' busiest total over a perfect split when each item
goes to the program free first (gluon_deal.py: the kernels deal items at run time, as the
hardware deals one program per item), items in the launch's order (sections of the KV heads
whose K/V fit in L2, each section's tiles heaviest first) and, for comparison, in the
schedule's order (all heads of a tile together); then the launch's order with items' times
jittered (each scaled by a uniform factor within ``--jitter``, the mean over ``--trials``
seeded draws), whole and as the launch deals it at d128 (gluon_halves.py: the last items as
two halves of their walks, each half paying the per-item cost and ``--merge-cost`` more).

    python tools/kernel_lab/deal_balance.py --out results/ [--sms 132] [--item-cost 2] [--l2-mb 50]

A work item is (query tile, head); its cost in key tiles: those it walks plus ``--item-cost``
for its Q load, first and last tiles and stores. A perfect split: the total over the programs,
or the heaviest item if that is more. A ratio of 1.03 means the launch's last program finishes
3% after a perfect one would: the most a better order could win. Writes
``<date>-deal-balance-<cpu>.json``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics

import torch

import spanattn as sa
from spanattn.backends.triton.configs import GLUON_CONFIGS
from spanattn.backends.triton.gluon_deal import kv_head_bytes, kv_heads_per_section
from spanattn.backends.triton.gluon_halves import halved_items
from spanattn.backends.triton.kernel_gluon import halves_tail
from spanattn.backends.triton.schedule import build_schedule
from spanattn.bench.cases import named_scenarios, packed_cases
from spanattn.scenarios import HKV, HQ

CASES = ("S0-128", "S0-256", "S1-128", "S1-256", "S2-128", "S2-256", "S3-256", "S4-128", "S5-512")


def tile_costs(sid: str, d: int, item_cost: float, scale: int = 1) -> tuple[torch.Tensor, int]:
    """float64 ``[tiles]``: an item's cost for each query tile of the schedule (heaviest first),
    and the step's keys (for the sections)."""
    sc = named_scenarios(scale)[sid]
    cfg = GLUON_CONFIGS[d]
    plan = sa.plan(sc.batch, sc.layer, "cpu")
    sched = build_schedule(plan, cfg.block_m, cfg.block_n)
    return sched.key_tiles().double() + item_cost, plan.total_k


def in_sections(tiles: torch.Tensor, section: int) -> torch.Tensor:
    """The items' costs in the launch's order (gluon_deal.item_place): sections of ``section``
    KV heads, each its tiles heaviest first with the section's query heads fastest."""
    heads = section * (HQ // HKV)
    return tiles.repeat_interleave(heads).repeat(HKV // section)


def greedy(costs: list[float], programs: int, jitter: float = 0.0, rng: random.Random | None = None) -> float:
    """The busiest program's total when each item goes to the program free first (each cost
    scaled by a factor drawn from ``[1 - jitter, 1 + jitter]`` with ``rng``, if given)."""
    free = [0.0] * programs
    for c in costs:
        if rng is not None:
            c *= 1 + rng.uniform(-jitter, jitter)
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def with_halves(costs: list[float], halves: int, item_cost: float, merge_cost: float) -> list[float]:
    """The deal's units when the last ``halves`` items run as two halves of their walks (the
    first with the extra key tile), each paying ``item_cost`` and ``merge_cost``.

    >>> with_halves([7.0, 5.0, 4.0], 2, 2.0, 0.5)
    [7.0, 4.5, 3.5, 3.5, 3.5]
    """
    units = costs[: len(costs) - halves]
    for c in costs[len(costs) - halves :]:
        walk = c - item_cost
        first = float(math.ceil(walk / 2))
        units += [first + item_cost + merge_cost, walk - first + item_cost + merge_cost]
    return units


def balance(tiles: torch.Tensor, section: int, programs: int, halve: bool = False, item_cost: float = 2.0,
            merge_cost: float = 0.5, jitter: float = 0.1, trials: int = 0) -> dict:  # fmt: skip
    """The busiest program over a perfect split, the launch's order and the schedule's; with
    ``trials``, jittered (whole, and halved as the launch halves where ``halve``)."""
    launch, schedule = in_sections(tiles, section).tolist(), in_sections(tiles, HKV).tolist()
    bound = max(sum(launch) / programs, max(launch))
    out = {
        "items": len(launch),
        "items_per_program": len(launch) / programs,
        "kv_heads_per_section": section,
        "greedy_over_perfect": greedy(launch, programs) / bound,
        "schedule_order_over_perfect": greedy(schedule, programs) / bound,
    }
    if trials:
        halves = halved_items(len(launch), programs) if halve else 0
        units = with_halves(launch, halves, item_cost, merge_cost)
        for key, costs in (("jittered_over_perfect", launch), ("halved_over_perfect", units)):
            rng = random.Random(0)
            out[key] = statistics.mean(greedy(costs, programs, jitter, rng) for _ in range(trials)) / bound
        out["halved_items"] = halves
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--sms", type=int, default=132, help="programs of a persistent launch (H200: 132)")
    ap.add_argument("--item-cost", type=float, default=2.0, help="key tiles' worth of work per item")
    ap.add_argument("--l2-mb", type=float, default=50.0, help="L2 cache in MiB (H200: 50)")
    ap.add_argument("--cases", default=",".join(CASES), help="scenario-head_dim, ...")
    ap.add_argument("--scale", type=int, default=1, help="divide token counts")
    ap.add_argument("--jitter", type=float, default=0.1, help="items' times scaled within 1 +- this")
    ap.add_argument("--trials", type=int, default=40, help="jittered deals per case (0: none)")
    ap.add_argument(
        "--merge-cost", type=float, default=0.5, help="key tiles' worth a halved walk adds per half"
    )
    args = ap.parse_args()
    from spanattn.bench.report import environment, result_path

    cases = packed_cases(ap, args.cases)
    rows = {}
    for case, (sid, d) in cases.items():
        tiles, keys = tile_costs(sid, d, args.item_cost, args.scale)
        section = kv_heads_per_section(HKV, kv_head_bytes(keys, d, 2), int(args.l2_mb * (1 << 20)))  # bf16
        rows[case] = r = balance(tiles, section, args.sms, halves_tail(d), args.item_cost, args.merge_cost,
                                 args.jitter, args.trials)  # fmt: skip
        jittered = (f", jittered {r['jittered_over_perfect']:.4f}, {r['halved_items']} items halved "
                    f"{r['halved_over_perfect']:.4f}" if args.trials else "")  # fmt: skip
        print(f"{case}: {r['items']} items, {r['items_per_program']:.1f} per program, sections of "
              f"{section} KV heads {r['greedy_over_perfect']:.4f}, schedule order "
              f"{r['schedule_order_over_perfect']:.4f} x perfect{jittered}", flush=True)  # fmt: skip
    env = environment("cpu")
    result = {**env, "sms": args.sms, "item_cost": args.item_cost, "l2_mb": args.l2_mb, "scale": args.scale,
              "jitter": args.jitter, "trials": args.trials, "merge_cost": args.merge_cost, "cases": rows,
              "notes": __doc__}  # fmt: skip
    path = result_path(args.out, "deal-balance", env)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
