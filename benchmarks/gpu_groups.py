"""Span groups on the GPU, checked and timed in one call.

1. The check grid: every spanattn backend that runs here on the mixed step with span groups
   (``scenarios.group_check_step``, positions x8) under each of its layers, and the split-KV
   decode kernel on ``group_decode_step``; triton at head_dim 128 (packed and over 16-token
   pages) and 256, flex, sdpa and fa4 at 128; the Gluon kernels (every sequence a key tile
   long: the step's first four sequences at positions x16) at 128, 256 and 512, packed and
   paged; each held to the fp64 rule (docs/design.md section 4) and, packed, to isolation (one
   sequence's NaN changes no other's bits).
2. The video scenarios (``scenarios.video_scenarios``: 64 frames x 256 tokens with 16-token
   timestamps, d128; a global layer and a W=1024 clamped one) and their twins without groups
   (the same frames as independent spans): our backends, FlexAttention with
   ``create_block_mask`` (compiled) and SDPA with the dense mask (our sdpa backend). Each item
   is checked against fp64 on the scenario at 1/8 size first, then timed; planning timed apart.
   The summary gives, per video layer, triton against the create_block_mask peer (kernel, and
   kernel + planning) and against the same step without groups per allowed pair.

    python benchmarks/gpu_groups.py --out benchmarks/results/     # H200: ~4 minutes
    python benchmarks/gpu_groups.py --out /tmp/groups             # no GPU: small sizes, fp32 (~1 min)

Writes ``<date>-groups-<gpu>.json`` (GPU name, torch/triton/transformers versions, date, every
row) and a PNG of TFLOP/s per scenario and backend.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import spanattn as sa  # noqa: E402
from spanattn.bench import inputs, report, run_item  # noqa: E402
from spanattn.bench.items import items  # noqa: E402
from spanattn.cache import to_paged  # noqa: E402
from spanattn.isolation import isolation_violations  # noqa: E402
from spanattn.oracle import Truth  # noqa: E402
from spanattn.scenarios import HKV, HQ, group_check_step, group_decode_step, video_scenarios  # noqa: E402

BACKENDS = ("triton", "flex", "sdpa", "fa4", "flex+create_block_mask")
OURS = ("triton", "fa4", "flex", "sdpa")


def environment(device) -> dict:
    env = report.environment(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def _qkv(plan, d, dtype, seed=1):
    g = torch.Generator(device=plan.device).manual_seed(seed)
    shapes = ((plan.total_q, 4), (plan.total_k, 2), (plan.total_k, 2))
    return [torch.randn(n, h, d, generator=g, device=plan.device).to(dtype) for n, h in shapes]


def _grid_row(name, plan, d, dtype, paged, what) -> dict:
    q, k, v = _qkv(plan, d, dtype)
    row = {"step": what, "layer": f"{plan.layer.window}/{plan.layer.spans}", "backend": name, "d": d}
    row["paged"] = paged
    why = sa.backends.load(name).unavailable(q, plan)
    if why is not None:
        return {**row, "status": "skipped", "reason": why}
    opts = {"backend": name, "return_lse": True}
    kk, vv = k, v
    if paged:
        kk, vv, opts["block_table"] = to_paged(k, v, plan, 16, fill=float("nan"))
    out, lse = sa.attention(q, kk, vv, plan, **opts)
    verdict = Truth(q, k, v, plan).check(out, lse, rounding_slack=True)
    run = lambda q_, k_, v_: sa.attention(
        q_, k_, v_, plan, **{o: x for o, x in opts.items() if o != "block_table"}
    )
    found = [] if paged else isolation_violations(run, q, k, v, plan, victim=0, value=float("nan"))
    ok = verdict.ok and not found
    return {**row, "status": "ok" if ok else "wrong", **verdict.as_dict(), "isolation": found}


def grid(device, big: bool, log) -> list[dict]:
    """The check grid (item 1 above): one row per backend, step, layer, head_dim and K/V form.
    On the GPU: triton at d128 packed and paged and d256 packed (the decode-shaped step at d128
    only), flex, sdpa and fa4 at d128, the Gluon kernels on the long step: each kernel variant
    compiles once, the whole grid in ~3 min."""
    m = 8 if big else 1
    batch, layers = group_check_step(m)
    long = sa.Batch(group_check_step(2 * m)[0].seqs[:4])
    d_main, d_wide = (128, 256) if big else (32, 64)
    gluon = [("triton", d, paged) for d in ((128, 256, 512) if big else ()) for paged in (False, True)]
    rows = []
    for lname, layer in layers.items():
        steps = (("mixed", batch), ("decode", group_decode_step(m))) + ((("long", long),) if big else ())
        for what, b in steps:
            plan = sa.plan(b, layer, device)
            if what == "long":
                runs = gluon
            else:
                runs = [("triton", d_main, False), ("triton", d_main, True), ("flex", d_main, False)]
                runs += [("sdpa", d_main, False)]
                runs += [("triton", d_wide, False), ("fa4", d_main, False)] if what == "mixed" else []
            for name, d, paged in runs:
                dtype = torch.bfloat16 if big else (torch.float16 if name == "triton" else torch.float32)
                row = _grid_row(name, plan, d, dtype, paged, f"{what} {lname}")
                rows.append(row)
                log(f"grid {what} {lname} {name} d{d}{' paged' if paged else ''}: {row['status']}")
    return rows


def bench(device, scale, check_scale, dtype, names, check: bool, log) -> list[dict]:
    """Every item of ``names`` on the video scenarios and their twins without groups."""
    full, small = video_scenarios(scale), video_scenarios(scale * check_scale)
    rows = []
    for sid, sc in full.items():
        plan = sa.plan(sc.batch, sc.layer, device)
        qkv = inputs(plan, 128, dtype, device, seed=0)
        for item in items(names):
            base = {"scenario": sid, "what": sc.what, "d": 128, "backend": item.name, "kind": item.kind}
            base["allowed_pairs"] = plan.allowed_pairs()
            try:
                row = {**base, **run_item(item, sc, small[sid], 128, plan, qkv, dtype, device, check)}
            except Exception as e:  # one broken item must not stop the others
                row = {**base, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            done = (
                f"{row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s" if "ms" in row else row.get("reason", "")
            )
            log(f"{sid} {item.name}: {row['status']} {done}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.add_ratios(rows)
    return rows


def summary(rows) -> list[dict]:
    """Per video layer: triton (and our other backends) against the create_block_mask peer, SDPA
    with the dense mask, and the same step without groups per allowed pair."""
    at = {(r["scenario"], r["backend"]): r for r in rows if r.get("status") == "ok"}
    out = []
    for sid in ("V1", "V2"):
        peer, dense = at.get((sid, "flex+create_block_mask")), at.get((sid, "sdpa"))
        for name in OURS:
            ours, plain = at.get((sid, name)), at.get((f"{sid}-plain", name))
            if ours is None:
                continue
            ratio = lambda a, b, key: (
                round(a[key] / b[key], 3) if a and b and a.get(key) and b.get(key) else None
            )
            out.append(
                {
                    "scenario": sid, "backend": name, "ms": ours["ms"], "tflops": ours["tflops"],
                    "vs_flex_create_block_mask": ratio(peer, ours, "ms"),
                    "vs_flex_create_block_mask_with_planning": ratio(peer, ours, "total_ms"),
                    "vs_sdpa_dense": ratio(dense, ours, "ms") if name != "sdpa" else None,
                    "per_pair_vs_without_groups": ratio(ours, plain, "tflops"),
                }
            )  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and PNG")
    ap.add_argument(
        "--scale", type=int, default=None, help="divide the video's lengths (default 1; 64 on CPU)"
    )
    ap.add_argument(
        "--check-scale", type=int, default=None, help="check at scale x this (default 8; 1 on CPU)"
    )
    ap.add_argument(
        "--backends",
        default=None,
        help=f"comma-separated subset of {BACKENDS} (default all; on CPU all but triton)",
    )
    ap.add_argument("--no-grid", action="store_true", help="skip the check grid")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = device.type == "cuda"
    scale, check_scale = a.scale or (1 if big else 64), a.check_scale or (8 if big else 1)
    dtype = torch.bfloat16 if big else torch.float32
    start = time.perf_counter()
    log = lambda text: print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)
    names = a.backends.split(",") if a.backends else [n for n in BACKENDS if big or n != "triton"]
    if not big:
        log(f"no CUDA device: small sizes (scale {scale}), fp32, flex eager, triton interpreted (in the")
        log("grid; timed only with --backends naming it: the interpreter takes ~30 s per video step)")
    meta = {**environment(device), "scale": scale, "check_scale": check_scale, "hq": HQ, "hkv": HKV}
    path = report.result_path(a.out, "groups", meta)
    meta["grid"] = [] if a.no_grid else grid(device, big, log)
    rows = bench(device, scale, check_scale, dtype, names, True, log)
    meta["summary"] = summary(rows)
    print(report.table(rows), flush=True)
    for s in meta["summary"]:
        log(f"summary {s}")
    report.write_json(path, meta, rows)
    drew = report.write_png(path.with_suffix(".png"), meta, rows)
    log(f"wrote {path}" + (" and its PNG" if drew else " (no matplotlib: no PNG)"))
    bad = [r for r in meta["grid"] + rows if r.get("status") in ("wrong", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
