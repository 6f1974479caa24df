"""The flex backend against FlexAttention with ``create_block_mask`` in one call, both compiled
the same two ways: is the kernel the same, and how much cheaper is the planning.

    python benchmarks/gpu_flex.py --out results/     # writes results/<date>-flex-<gpu>.json

Per scenario (S0-S4, each head_dim): kernel time of our flex backend compiled dynamic (its
default) and static (``SPANATTN_FLEX_DYNAMIC=0``), and of the peer, ``flex_attention`` over a
``create_block_mask`` BlockMask, compiled the same two ways. Planning: host
wall (synced) of ``spanattn.plan``, of the flex tables on top, and of ``create_block_mask``
eager and compiled. Before timing, both of our variants are checked against fp64 on the mixed
check step (NaN-poisoned outputs are impossible here: flex allocates its own).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

import spanattn as sa
from spanattn.backends import flex as fb
from spanattn.bench.report import environment, result_path
from spanattn.bench.timing import host_ms
from spanattn.oracle import Truth
from spanattn.scenarios import HKV, HQ, check_step, scenarios

DEV = "cuda"
# Every variant compiles per shape at least once; the default limit (8) would silently send the
# later scenarios to eager flex.
torch._dynamo.config.cache_size_limit = 256
if hasattr(torch._dynamo.config, "recompile_limit"):
    torch._dynamo.config.recompile_limit = 256


def set_dynamic(dynamic: bool):
    fb.DYNAMIC = dynamic
    fb._compiled.cache_clear()


def rand_qkv(p, d):
    g = lambda n, h: torch.randn(n, h, d, device=DEV, dtype=torch.bfloat16)
    return g(p.total_q, HQ), g(p.total_k, HKV), g(p.total_k, HKV)


def check_one(batch, layer, d):
    p = sa.plan(batch, layer, device=DEV)
    q, k, v = rand_qkv(p, d)
    out, lse = fb.forward(q, k, v, p, scale=d**-0.5, return_lse=True)
    return Truth(q, k, v, p, scale=d**-0.5).check(out, lse).as_dict()


def check(res):
    batch, layers = check_step()
    rows = []
    for dynamic in (True, False):
        set_dynamic(dynamic)
        for name, layer in layers.items():
            for d in (128, 256):
                rows.append({"dynamic": dynamic, "layer": name, "d": d, **check_one(batch, layer, d)})
    bad = [r for r in rows if not r["ok"]]
    print(f"check: {len(rows) - len(bad)}/{len(rows)} ok", flush=True)
    for r in bad:
        print("  FAIL", r)
    res["check"] = {"cases": len(rows), "failed": len(bad), "rows": rows}


def peer_mask(p):
    alo, ahi = p.packed_intervals()
    return lambda b, h, q_idx, kv_idx: (kv_idx >= alo[q_idx]) & (kv_idx <= ahi[q_idx])


def kernel_ms(fn):
    fn()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_one(sc, sid, d, peers):
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    q, k, v = rand_qkv(p, d)
    row = {"scenario": sid, "d": d, "allowed_pairs": p.allowed_pairs()}
    for dynamic in (True, False):
        set_dynamic(dynamic)
        ms = kernel_ms(lambda: fb.forward(q, k, v, p, scale=d**-0.5))
        row["ours_dynamic_ms" if dynamic else "ours_static_ms"] = ms
    bm = create_block_mask(peer_mask(p), None, None, p.total_q, p.total_k, device=DEV)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    for name, run in peers.items():
        row[name] = kernel_ms(lambda r=run: r(q4, k4, v4, block_mask=bm, scale=d**-0.5, enable_gqa=True))
    row["plan_core_ms"] = host_ms(lambda: sa.plan(sc.batch, sc.layer, device=DEV), DEV)
    row["plan_flex_ms"] = host_ms(lambda: fb.prepare(sa.plan(sc.batch, sc.layer, device=DEV)), DEV)
    mask_mod = peer_mask(p)
    for name, kw in (("cbm_eager_ms", {}), ("cbm_compiled_ms", {"_compile": True})):
        cbm = lambda kw=kw: create_block_mask(mask_mod, None, None, p.total_q, p.total_k, device=DEV, **kw)
        row[name] = host_ms(cbm, DEV)
    row["kernel_vs_peer_static"] = row["ours_dynamic_ms"] / row["peer_static_ms"]
    row["dynamic_vs_peer_dynamic"] = row["ours_dynamic_ms"] / row["peer_dynamic_ms"]
    row["static_vs_peer_static"] = row["ours_static_ms"] / row["peer_static_ms"]
    row["planning_x"] = min(row["cbm_eager_ms"], row["cbm_compiled_ms"]) / row["plan_flex_ms"]
    return row


# Two wrappers, not two torch.compile calls on flex_attention itself: dynamo caches compiled
# frames per code object, so a second compile of the same function would reuse the first's kernels.
def _peer_static(*args, **kw):
    return flex_attention(*args, **kw)


def _peer_dynamic(*args, **kw):
    return flex_attention(*args, **kw)


def bench(res, only):
    res["bench"] = []
    peers = {
        "peer_static_ms": torch.compile(_peer_static, dynamic=False),
        "peer_dynamic_ms": torch.compile(_peer_dynamic, dynamic=True),
    }
    for sid, sc in scenarios().items():
        if sc.decode or sc.head_dims == (512,) or (only and sid not in only):
            continue
        for d in sc.head_dims:
            row = bench_one(sc, sid, d, peers)
            print({a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()}, flush=True)
            res["bench"].append(row)
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--scenarios", default="", help="comma-separated ids (default S0-S4)")
    a = ap.parse_args()
    res = {**environment("cuda"), "flops_rule": "4 * D * Hq * allowed pairs, bf16, Hq=16, Hkv=8"}
    t0 = time.time()
    check(res)
    print(f"[check done at {time.time() - t0:.0f} s]", flush=True)
    bench(res, [x for x in a.scenarios.split(",") if x])
    print(f"[bench done at {time.time() - t0:.0f} s]", flush=True)
    path = result_path(a.out, "flex", res)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
