"""Paged prefill vs contiguous varlen prefill with the triton backend, and planning time, on
one GPU in one call.

    python benchmarks/gpu_paged_prefill.py --out results/   # writes results/<date>-paged-prefill-<gpu>.json

paged: S1-S3 (docs/design.md section 5; bf16, Hq 16 / Hkv 8) with K/V written into a paged cache
    whose pages are scattered at random (page 16 and 128), read the default way (on Hopper a
    Gluon kernel reads them in place), and the triton kernel's two ways (walk them in place /
    copy them out first, which lets TMA and the Gluon kernels read them) and the copy alone.
    The paged output equals the contiguous one bit for bit where both run one kernel on the
    same key tiles (pages copied out; a Gluon kernel reading pages does not shift the last key
    tile back as on packed K/V, so its sums round differently), and a down-scaled copy of each
    step is checked against fp64 truth under err <= 2 * err(same-dtype reference)
    + 1e-4 with a NaN-poisoned cache. Then both are timed (median of triton.testing.do_bench).
plan: spanattn.plan(batch, layer, device="cuda") per step, host wall time with a device sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spanattn as sa  # noqa: E402
from spanattn.backends import triton as tb  # noqa: E402
from spanattn.backends.triton.configs import pick, pick_gluon  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.oracle import Truth  # noqa: E402
from spanattn.scenarios import HKV, HQ, scenarios  # noqa: E402


def paged_copy(k, v, plan, page, gen):
    """A cache with every sequence's keys on randomly scattered pages, NaN everywhere else."""
    pages = [-(-s.kv_len // page) for s in plan.batch.seqs]
    total = sum(pages) + 8
    perm = torch.randperm(total, generator=gen)[: sum(pages)].tolist()
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(perm[at : at + n])
        at += n
    table = table.cuda()
    shape = (total, page, k.shape[1], k.shape[2])
    kc = torch.full(shape, float("nan"), dtype=k.dtype, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    sa.write_kv_cache(k, v, kc, vc, _all_slots(plan, table, page))
    return kc, vc, table


def _all_slots(plan, table, page):
    rows = []
    for i, s in enumerate(plan.batch.seqs):
        pos = torch.arange(s.kv_len, device="cuda")
        rows.append(table[i].long()[pos // page] * page + pos % page)
    return torch.cat(rows)


def qkv(plan, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g, device="cuda", dtype=dtype)
    return mk(plan.total_q, HQ), mk(plan.total_k, HKV), mk(plan.total_k, HKV)


def route(q, kc, vc, p, page, block_n):
    """How the default path reads the pages: a Gluon kernel in place, a copy first, or the triton
    kernel walking them."""
    gcfg = pick_gluon(q.shape[-1], q.dtype)
    if gcfg and tb.gluon_reads_pages(q, kc.flatten(0, 1), vc.flatten(0, 1), p, gcfg, page):
        return "gluon reads pages"
    return "copy" if tb.copies_pages(q, p, page, block_n, HKV) else "walk"


def both_ways(q, kc, vc, table, p, page, ref, t_contig):
    """The in-place walk and the copy-out path timed side by side, and the copy alone."""
    res = {}
    rules = tb.gluon_reads_pages, tb.copies_pages
    try:
        tb.gluon_reads_pages = lambda *args, **kwargs: False
        for name, copies in (("walk", False), ("copy", True)):
            tb.copies_pages = lambda *args, copies=copies, **kwargs: copies
            # A fresh plan each: a plan keeps the route its first call of a shape took (later
            # calls only launch), so ``p`` would run the default's route under any rule.
            fresh = sa.plan(p.batch, p.layer, device="cuda")
            fn = partial(sa.attention, q, kc, vc, fresh, block_table=table, backend="triton")
            equal = bool(torch.equal(fn(), ref))
            res[f"{name}_ms"] = t = do_bench(fn, rep=200)
            res[f"{name}_over_contiguous"] = t / t_contig
            res[f"{name}_bit_equal"] = equal
    finally:
        tb.gluon_reads_pages, tb.copies_pages = rules
    flat = (kc.flatten(0, 1), vc.flatten(0, 1))
    res["copy_only_ms"] = do_bench(lambda: tb._copy_pages(p, *flat, table, page), rep=200)
    res["copy_bytes"] = 4 * p.total_k * kc.shape[2] * kc.shape[3] * kc.element_size()
    return res


def check_small(sc_small, d, page, gen):
    p = sa.plan(sc_small.batch, sc_small.layer, device="cuda")
    q, k, v = qkv(p, d, seed=1)
    kc, vc, table = paged_copy(k, v, p, page, gen)
    out = sa.attention(q, kc, vc, p, block_table=table, backend="triton")
    return Truth(q, k, v, p).check(out).as_dict()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for the JSON")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    full, small = scenarios(), scenarios(scale=8)
    res = {
        **environment("cuda"),
        "plan_ms": {},
        "rows": [],
    }
    for sid in ("S0", "S1", "S2", "S3", "S4", "D1"):
        sc = full[sid]
        for _ in range(3):
            sa.plan(sc.batch, sc.layer, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            sa.plan(sc.batch, sc.layer, device="cuda")
        torch.cuda.synchronize()
        res["plan_ms"][sid] = (time.perf_counter() - t) / 20 * 1e3
        print(f"plan {sid}: {res['plan_ms'][sid]:.3f} ms", flush=True)
    for sid, d in (("S1", 128), ("S1", 256), ("S2", 128), ("S2", 256), ("S3", 256)):
        sc = full[sid]
        p = sa.plan(sc.batch, sc.layer, device="cuda")
        q, k, v = qkv(p, d)
        flops = 4 * d * HQ * p.allowed_pairs()
        contiguous = partial(sa.attention, q, k, v, p, backend="triton")
        ref = contiguous()
        t_contig = do_bench(contiguous, rep=200)
        walk_cfg = pick(d, q.dtype, False, sc.layer.window, tma=False)
        for page in (16, 128):
            kc, vc, table = paged_copy(k, v, p, page, gen)
            paged = partial(sa.attention, q, kc, vc, p, block_table=table, backend="triton")
            out = paged()
            t_paged = do_bench(paged, rep=200)
            row = {
                "scenario": sid, "d": d, "page": page,
                "contiguous_ms": t_contig, "paged_ms": t_paged,
                "paged_over_contiguous": t_paged / t_contig,
                "paged_tflops": flops / t_paged / 1e9, "contiguous_tflops": flops / t_contig / 1e9,
                "route": route(q, kc, vc, p, page, walk_cfg.block_n),
                "bit_equal": bool(torch.equal(out, ref)),
                "check_small": check_small(small[sid], d, page, gen),
            }  # fmt: skip
            row.update(both_ways(q, kc, vc, table, p, page, ref, t_contig))  # whatever the default picks
            res["rows"].append(row)
            print(
                f"{sid} d{d} page {page}: contiguous {t_contig:.3f} ms, paged {t_paged:.3f} ms "
                f"({row['paged_over_contiguous']:.3f}x, {row['route']}), "
                f"bit-equal {row['bit_equal']}, small check {row['check_small']['ok']}"
                + (f", walk {row['walk_over_contiguous']:.3f}x, copy {row['copy_over_contiguous']:.3f}x"
                   f" (copy alone {row['copy_only_ms']:.3f} ms)" if "walk_ms" in row else ""),
                flush=True,
            )  # fmt: skip
    path = result_path(a.out, "paged-prefill", res)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
