"""Host time of a span-group step's planning, piece by piece, on the video scenarios
(``scenarios.video_scenarios``: 64 frames x 256 tokens with timestamps, one group; V1 global,
V2 a clamped window) and their twins without groups: ``sa.plan``, its ``span_groups`` part, the
triton backend's ``prepare`` for the Gluon kernels (tile schedule with the group walk, key tile
groups), and the torch definitions that the launches replace (held equal to them first).

    python benchmarks/group_planning.py --out benchmarks/results/   # GPU: ~30 s
    python benchmarks/group_planning.py --out /tmp/gp              # no GPU: 1/32 size, interpreter

Each number is the median of synchronized calls (spanattn.bench.timing.host_ms). Writes
``<date>-group-planning-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the launches run in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import spanattn as sa  # noqa: E402
from spanattn.backends import triton as tb  # noqa: E402
from spanattn.backends.triton.group_walk import group_walk, key_tile_groups  # noqa: E402
from spanattn.backends.triton.key_tile_groups_triton import key_tile_groups_triton  # noqa: E402
from spanattn.backends.triton.schedule_triton import build_schedule_triton  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.bench.timing import host_ms  # noqa: E402
from spanattn.groups import span_groups  # noqa: E402
from spanattn.intervals import step_tensors  # noqa: E402
from spanattn.scenarios import video_scenarios  # noqa: E402


def measure(sid, sc, device, reps: int) -> dict:
    batch, layer = sc.batch, sc.layer
    plan = sa.plan(batch, layer, device)
    time = lambda fn: round(host_ms(fn, device, reps), 4)
    row = {"scenario": sid, "total_k": plan.total_k, "plan_ms": time(lambda: sa.plan(batch, layer, device))}
    prepare = lambda: tb.prepare(sa.plan(batch, layer, device), 128, torch.bfloat16)
    row["plan_and_prepare_ms"] = time(prepare)  # a fresh plan each time: nothing cached
    row["schedule_ms"] = time(lambda: build_schedule_triton(plan, 128, 128))
    if plan.groups is not None:
        step = step_tensors(batch, torch.device(device))
        sched, g = build_schedule_triton(plan, 128, 128), plan.groups
        assert torch.equal(sched.walk, group_walk(plan, sched))
        assert torch.equal(key_tile_groups_triton(g, 128), key_tile_groups(g, 128))
        row["span_groups_ms"] = time(lambda: span_groups(layer, step, batch.total_q, batch.total_k))
        row["key_tile_groups_launch_ms"] = time(lambda: key_tile_groups_triton(g, 128))
        row["group_walk_torch_ms"] = time(lambda: group_walk(plan, sched))
        row["key_tile_groups_torch_ms"] = time(lambda: key_tile_groups(g, 128))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scale, reps = (1, 50) if device == "cuda" else (32, 2)
    meta = {**environment(device), "scale": scale, "reps": reps, "notes": __doc__}
    rows = []
    for sid, sc in video_scenarios(scale).items():
        rows.append(measure(sid, sc, device, reps))
        print(json.dumps(rows[-1]), flush=True)
    path = result_path(a.out, "group-planning", meta)
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
