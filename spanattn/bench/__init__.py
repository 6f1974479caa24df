"""``spanattn bench``: the standard scenarios (docs/design.md section 5) on this machine for
every available backend and the peers users would run instead (FlexAttention with
``create_block_mask``, SDPA flash causal, FA4's built-in causal/window when ``flash_attn.cute``
imports).

Every item is checked against the fp64 reference before it is timed (docs/design.md section 4's rule,
memory poisoned with NaN first); the reference of a 32k step is too heavy, so the check runs
on the same scenario scaled down (``--check-scale``, default 8: ``scenarios(scale=8)``).
Without a GPU it runs small versions (``--scale 16``, float32) and says so.

    python -m spanattn.bench --scenarios S0,S1 --head-dims 128 --out results/
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch

import spanattn as sa
from spanattn.oracle import Truth
from spanattn.scenarios import HKV, HQ, scenarios

from . import report, timing
from .items import Item, items

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ids = ",".join(scenarios())
    parser.add_argument("--scenarios", default=None, help=f"comma-separated subset of {ids} (default: all)")
    parser.add_argument(
        "--head-dims", default=None, help="comma-separated head dims (default: each scenario's)"
    )
    parser.add_argument("--backends", default=None, help="comma-separated backends/peers (default: all)")
    parser.add_argument("--scale", type=int, default=None, help="divide token counts (default 1; 16 on CPU)")
    parser.add_argument(
        "--check-scale",
        type=int,
        default=None,
        help="check each item on scenarios(scale * this) (default 8; 1 on CPU)",
    )
    parser.add_argument("--no-check", action="store_true", help="time without checking against the reference")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (fp32 on CPU)")
    parser.add_argument("--out", default="bench-out", help="folder for the JSON and PNG (default bench-out/)")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")


def inputs(plan, d, dtype, device, seed):
    """Random packed ``q, k, v`` of a plan at the scenarios' head counts (HQ, HKV)."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((plan.total_q, HQ), (plan.total_k, HKV), (plan.total_k, HKV))
    return [torch.randn(n, h, d, generator=g, device=device, dtype=dtype) for n, h in shapes]


def _check(item: Item, sc, d, dtype, device, scale) -> dict:
    """Run the item on fresh inputs of ``sc`` (already down-scaled) and hold it to the rule."""
    plan = sa.plan(sc.batch, sc.layer, device)
    q, k, v = inputs(plan, d, dtype, device, seed=1)
    why = item.unavailable(sc, plan, q)
    if why is not None:
        return {"ok": None, "why": f"not checked: {why} at the check size"}
    timing.poison(device, 4 * q.numel() * 4)
    out = item.make(plan, q, k, v, scale)()
    # one rounding step of slack: an fp32 sum in another order may round a bf16 output the other way
    verdict = Truth(q, k, v, plan, scale=scale).check(out, rounding_slack=True)
    return {"ok": verdict.ok, "err": verdict.err, "bound": verdict.bound, "tokens": plan.total_q}


def run_item(item: Item, sc, small, d, plan, qkv, dtype, device, check: bool) -> dict:
    """One row of the benchmark: ``item`` checked on ``small`` (the scenario scaled down) against
    the fp64 rule, then timed on ``plan`` and ``qkv``, with its planning time."""
    scale = 1.0 / math.sqrt(d)
    why = item.unavailable(sc, plan, qkv[0])
    if why is not None:
        return {"status": "skipped", "reason": why}
    row = {"exact_mask": bool(item.exact(sc))}
    if item.note:
        row["note"] = item.note
    if not item.exact(sc):
        row["note"] = "speed of light: built-in mask without spans, not checked"
    elif check:
        row["check"] = _check(item, small, d, dtype, device, scale)
        if row["check"]["ok"] is False:
            c = row["check"]
            return {
                **row,
                "status": "wrong",
                "reason": f"error {c['err']:.3g} > bound {c['bound']:.3g}",
            }
    fn = item.make(plan, *qkv, scale)
    row["ms"] = timing.kernel_ms(fn, device)
    row["tflops"] = 4 * d * HQ * plan.allowed_pairs() / (row["ms"] * 1e-3) / 1e12
    if item.planning is not None:
        row["plan_ms"] = timing.host_ms(item.planning(sc, device, d), device)
        if item.kind == "spanattn":  # of which spanattn.plan alone (the rest: the backend's tables)
            row["plan_core_ms"] = timing.host_ms(lambda: sa.plan(sc.batch, sc.layer, device), device)
        if item.name == "flex+create_block_mask" and torch.device(device).type == "cuda":
            # the peer at its best: create_block_mask compiled too; the faster one counts
            row["plan_ms_eager"] = row["plan_ms"]
            row["plan_ms_compiled"] = timing.host_ms(item.planning(sc, device, d, compiled=True), device)
            row["plan_ms"] = min(row["plan_ms_eager"], row["plan_ms_compiled"])
        row["total_ms"] = row["ms"] + row["plan_ms"]
    return {**row, "status": "ok"}


def _recompile_probe(device, dtype) -> dict | None:
    """New S1-like steps of other lengths through the flex backend after the scenarios ran:
    how many new graphs did torch.compile build for each?"""
    from torch._dynamo.utils import counters

    from spanattn.backends import flex
    from spanattn.scenarios import even_spans

    lengths, new_graphs = (20001, 24577, 30111, 28672), []
    for n in lengths:
        before = int(counters["stats"]["unique_graphs"])
        batch = sa.Batch([sa.Seq(n, spans=even_spans(n, 8, 700))])
        plan = sa.plan(batch, sa.LayerMask(window=1024, spans="clamp"), device)
        q, k, v = inputs(plan, 128, dtype, device, seed=2)
        flex.forward(q, k, v, plan, scale=128**-0.5)
        new_graphs.append(int(counters["stats"]["unique_graphs"]) - before)
    return {"lengths": lengths, "new_graphs": new_graphs}


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    scale = args.scale or (1 if on_gpu else 16)
    check_scale = args.check_scale or (8 if on_gpu else 1)
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    all_sc, small_sc = scenarios(scale), scenarios(scale * check_scale)
    ids = args.scenarios.split(",") if args.scenarios else list(all_sc)
    unknown = [i for i in ids if i not in all_sc]
    if unknown:
        print(f"spanattn bench: unknown scenarios {unknown}; choose from {list(all_sc)}", file=sys.stderr)
        return 2
    dims = [int(x) for x in args.head_dims.split(",")] if args.head_dims else None
    chosen = items(args.backends.split(",") if args.backends else None)
    if args.backends and len(chosen) != len(set(args.backends.split(","))):
        names = [i.name for i in items()]
        print(f"spanattn bench: unknown backends in {args.backends!r}; choose from {names}", file=sys.stderr)
        return 2
    if not on_gpu:
        print(
            f"NOTE: no CUDA device: running SMALL versions (token counts / {scale}, {str(dtype)[6:]}, "
            "flex eager); CPU times, not comparable with GPU numbers",
            flush=True,
        )
    print(
        f"checking every item against the fp64 reference on scenarios(scale={scale * check_scale}) "
        f"before timing it{' (disabled)' if args.no_check else ''}; {report.FLOPS_NOTE}",
        flush=True,
    )
    meta = report.environment(device)
    meta.update(scale=scale, check_scale=check_scale, dtype=str(dtype)[6:], hq=HQ, hkv=HKV)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "-", meta["gpu"] or "cpu").strip("-").lower()
    stem = out / f"bench-{name}-{meta['date'][:10]}"
    cases = [(sid, d) for sid in ids for d in (dims or all_sc[sid].head_dims)]
    rows, n, total = [], 0, len(cases) * len(chosen)
    for sid, d in cases:
        sc = all_sc[sid]
        plan = sa.plan(sc.batch, sc.layer, device)
        qkv = inputs(plan, d, dtype, device, seed=0)
        for item in chosen:
            n += 1
            base = {"scenario": sid, "what": sc.what, "d": d, "backend": item.name, "kind": item.kind}
            if sc.decode:
                base["note"] = "packed contiguous K/V (not paged)"
            try:
                row = {
                    **base,
                    **run_item(item, sc, small_sc[sid], d, plan, qkv, dtype, device, not args.no_check),
                }
            except Exception as e:  # one broken item must not stop the others
                row = {**base, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            done = (
                f"{row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s" if "ms" in row else row.get("reason", "")
            )
            print(f"[{n}/{total}] {sid} d{d} {item.name}: {row['status']} {done}", flush=True)
            report.write_json(stem.with_suffix(".json"), meta, rows)  # a killed run keeps its rows
            if on_gpu:
                torch.cuda.empty_cache()
        del qkv, plan
    report.add_ratios(rows)
    if on_gpu and any(i.name == "flex" for i in chosen):
        try:
            meta["flex_recompile_probe"] = _recompile_probe(device, dtype)
        except Exception as e:
            meta["flex_recompile_probe"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"flex recompile probe: {meta['flex_recompile_probe']}", flush=True)
    print(report.table(rows), flush=True)
    report.write_json(stem.with_suffix(".json"), meta, rows)
    drew = report.write_png(stem.with_suffix(".png"), meta, rows)
    print(f"wrote {stem}.json" + (f" and {stem}.png" if drew else " (no matplotlib: no PNG)"), flush=True)
    return 1 if any(r["status"] in ("wrong", "error") for r in rows) else 0
