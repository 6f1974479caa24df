"""Check and time the fa4 backend on one GPU in one call (needs FlashAttention-4 importable:
``pip install flash-attn-4``, or the archive tools/fa4_bundle.sh packs).

    python benchmarks/gpu_fa4.py --parts check,count,bench --out results/

Writes results/<date>-fa4-<gpu>.json, after every part.

check: correctness grid (bf16/fp16, D 64/128/256, GQA 1/2/8, windows, span modes, mixed batches,
    softcap, LSE) on both paths (FA4's built-in causal/window, once per causal flag where a step
    has both, and the interval mask_mod with block-sparse tables), held to docs/design.md section 4's
    rule; outputs land in NaN-poisoned memory.
count: FA4 kernel compilations over random steps (lengths, spans, flags, batch size change).
mixed: a serving step (prefill chunks with images, 64 decode rows, canvases): fa4 vs triton.
flags: S4 on the built-in kernel once per causal flag: a side stream vs one stream (either
    order) vs the sparse path, alternating with the built-in kernel on the causal twin.
alternate: fa4 and FA4's built-in timed in alternation over several rounds (--scenarios S1).
anatomy: where the sparse path's time goes on S1: the same machinery on the plain window mask
    (the built-in's own mask), and again with every visited tile marked FULL (the mask never
    evaluated: a timing control, its output is wrong), each in alternation with the built-in.
bench: scenarios S0-S4: the fa4 backend against FA4's built-in causal/window mask on the same
    step (the speed of light: it ignores spans), FA4 with the interval mask_mod and no block
    sparsity (the shape vLLM's mm_prefix path runs), and our triton backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import time

import torch

import spanattn as sa
from spanattn.backends import fa4, fa4_flags
from spanattn.backends import triton as tb
from spanattn.bench.report import environment, result_path
from spanattn.bench.timing import host_ms, kernel_ms, poison, rotated
from spanattn.oracle import Truth
from spanattn.scenarios import HKV, HQ, check_step, scenarios

DEV = "cuda"


def rand_qkv(p, hq, hkv, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda n, h: torch.randn(n, h, d, device=DEV, dtype=dtype, generator=g)
    return r(p.total_q, hq), r(p.total_k, hkv), r(p.total_k, hkv)


def check_one(batch, layer, dtype, d, hq, hkv, softcap=None):
    p = sa.plan(batch, layer, device=DEV)
    q, k, v = rand_qkv(p, hq, hkv, d, dtype)
    scale = d**-0.5
    poison(DEV, 8 * q.numel() * q.element_size())  # FA4 allocates its output: make it NaN first
    t0 = time.perf_counter()
    out, lse = fa4.forward(q, k, v, p, scale=scale, softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    verdict = Truth(q, k, v, p, scale=scale, softcap=softcap).check(out, lse, rounding_slack=True)
    path = "builtin" if len(fa4_flags.flags(p)) == 1 else "builtin per flag"
    path = path if fa4.builtin(p) else "sparse"
    return {"path": path, "first_call_s": first_s, **verdict.as_dict()}


def grid():
    """The GPU check step under every layer kind (the sparse path; "causal_flags", spans off with
    a non-causal canvas, takes the built-in kernel once per flag), the same with windows and spans
    off (per flag, both non-causal window kinds), plus an all-causal batch for the one-launch
    built-in path."""
    mixed, layers = check_step()
    causal = sa.Batch([sa.Seq(q_len=700, kv_len=1300), sa.Seq(q_len=1, kv_len=517), sa.Seq(129)])
    rename = {"causal": "causal_flags"}
    cases = {("mixed", rename.get(name, name)): (mixed, layer) for name, layer in layers.items()}
    cases[("mixed", "W64_flags")] = (mixed, sa.LayerMask(window=64, spans="off"))
    wide = sa.LayerMask(window=64, spans="off", noncausal_window="inclusive")
    cases[("mixed", "W64_inclusive_flags")] = (mixed, wide)
    cases[("causal", "causal")] = (causal, sa.LayerMask(spans="off"))  # built-in
    cases[("causal", "W64")] = (causal, sa.LayerMask(window=64))  # built-in window
    return cases


def part_check(res, log, quick=False):
    rows = []
    cases = [(torch.bfloat16, d, 16, 8) for d in ((128,) if quick else (64, 128, 256))]
    if not quick:
        cases += [(torch.bfloat16, 128, 8, 8), (torch.bfloat16, 128, 16, 2), (torch.float16, 128, 16, 8)]
    for dtype, d, hq, hkv in cases:
        for (bname, lname), (batch, layer) in grid().items():
            if (hq, hkv) != (16, 8) or dtype != torch.bfloat16:
                if lname not in ("on", "causal"):
                    continue  # GQA and dtype variants: one layer per path is enough
            r = check_one(batch, layer, dtype, d, hq, hkv)
            rows.append({"dtype": str(dtype), "d": d, "hq": hq, "hkv": hkv, "case": f"{bname}/{lname}", **r})
            log(f"check {rows[-1]}")
    for d in () if quick else (128, 256):
        for name in (("mixed", "W200_on"), ("causal", "causal")):
            batch, layer = grid()[name]
            r = check_one(batch, layer, torch.bfloat16, d, 16, 8, softcap=30.0)
            case = "/".join(name) + "+softcap"
            rows.append({"dtype": "bf16", "d": d, "hq": 16, "hkv": 8, "case": case, **r})
            log(f"check {rows[-1]}")
    for sid, sc in scenarios(8).items():  # the standard steps at 1/8 size
        if sc.decode:
            continue
        for d in (x for x in sc.head_dims if x <= (128 if quick else 256)):
            r = check_one(sc.batch, sc.layer, torch.bfloat16, d, HQ, HKV)
            rows.append({"dtype": "bf16", "d": d, "hq": HQ, "hkv": HKV, "case": f"{sid} at 1/8", **r})
            log(f"check {rows[-1]}")
    res["check"] = rows
    res["check_all_ok"] = all(r["ok"] for r in rows)


COMPILES = [0]


def _count_compiles():
    """Count cute.compile calls: FA4 compiles once per new kernel key and caches the result."""
    import cutlass.cute as cute

    compile_ = cute.compile

    def counted(*a, **kw):
        COMPILES[0] += 1
        return compile_(*a, **kw)

    cute.compile = counted


def _compiles() -> int:
    return COMPILES[0]


def part_count(res, log, steps=30):
    _count_compiles()
    rnd = random.Random(0)
    before = _compiles()
    per_step = []
    for i in range(steps):
        seqs = []
        for _ in range(rnd.randint(1, 6)):
            kv = rnd.randint(1, 3000)
            q = kv if rnd.random() < 0.5 else rnd.randint(1, kv)
            a = rnd.randint(0, kv - 1)
            spans = [(a, min(kv - 1, a + rnd.randint(1, 400)))] if rnd.random() < 0.7 else []
            seqs.append(sa.Seq(q_len=q, kv_len=kv, spans=spans, causal=rnd.random() < 0.85))
        layer = sa.LayerMask(window=rnd.choice([None, 256]), spans=rnd.choice(["on", "clamp"]))
        p = sa.plan(sa.Batch(seqs), layer, device=DEV)
        q, k, v = rand_qkv(p, HQ, HKV, 128, torch.bfloat16, seed=i)
        n0 = _compiles()
        fa4.forward(q, k, v, p, scale=128**-0.5)
        per_step.append(_compiles() - n0)
    res["count"] = {"steps": steps, "new_compiles_total": _compiles() - before, "per_step": per_step}
    log(f"count {res['count']}")


def _fa4_builtin(p, q, k, v, scale):
    from flash_attn.cute import flash_attn_varlen_func

    w = p.layer.window
    win = (None, None) if w is None else (w - 1, 0)
    return lambda: flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
        max_seqlen_k=p.max_seqlen_k, softmax_scale=scale, causal=True, window_size=win,
    )  # fmt: skip


def _fa4_maskmod_dense(p, q, k, v, scale):
    """FA4 with the same interval mask_mod but no block sparsity: every tile evaluates it."""
    from flash_attn.cute import flash_attn_func

    _, aux = fa4.sparse_inputs(p, q.shape[-1])
    mm = fa4._interval_mask_mod()
    kw = {"softmax_scale": scale, "causal": False, "mask_mod": mm, "aux_tensors": aux}
    return lambda: flash_attn_func(q[None], k[None], v[None], **kw)


def bench_one(sid, sc, d):
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    q, k, v = rand_qkv(p, HQ, HKV, d, torch.bfloat16)
    scale, flops = d**-0.5, 4 * d * HQ * p.allowed_pairs()
    row = {"scenario": sid, "d": d, "path": "builtin" if fa4.builtin(p) else "sparse"}
    fa4.prepare(p, d)
    fns = {
        "fa4 (ours)": lambda: fa4.forward(q, k, v, p, scale=scale),
        "triton (ours)": lambda: tb.forward(q, k, v, p, scale=scale),
        "fa4 built-in causal/window": _fa4_builtin(p, q, k, v, scale),
    }
    if sid in ("S1", "S2"):
        fns["fa4 mask_mod, no block sparsity"] = _fa4_maskmod_dense(p, q, k, v, scale)
    for name, fn in fns.items():
        ms = kernel_ms(fn, DEV)
        row[name] = {"ms": ms, "tflops": flops / ms / 1e9}
    row["ours_vs_builtin"] = row["fa4 built-in causal/window"]["ms"] / row["fa4 (ours)"]["ms"]
    row["plan_ms"] = host_ms(lambda: fa4.prepare(sa.plan(sc.batch, sc.layer, DEV), d), DEV)
    if not fa4.builtin(p):
        t = fa4.sparse_inputs(p, d)[0]
        row["tiles"] = {"partial": int(t.kv_num_blocks.sum()), "full": int(t.full_kv_num_blocks.sum())}
    return row


def part_bench(res, log, ids):
    rows = []
    for sid, sc in scenarios(1).items():
        for d in (x for x in sc.head_dims if x <= 256 and sid in ids):
            rows.append(bench_one(sid, sc, d))
            log(f"bench {rows[-1]}")
    res["bench"] = rows


def part_alternate(res, log, ids, rounds=9):
    """fa4 and the built-in timed in alternation, ``rounds`` times per scenario: both see the same
    clocks and L2 state drift, so the median of the per-round ratios is steadier than one pair."""
    rows = []
    for sid, sc in scenarios(1).items():
        for d in (x for x in sc.head_dims if x <= 256 and sid in ids):
            p = sa.plan(sc.batch, sc.layer, device=DEV)
            q, k, v = rand_qkv(p, HQ, HKV, d, torch.bfloat16)
            scale = d**-0.5
            fa4.prepare(p, d)
            ours = functools.partial(fa4.forward, q, k, v, p, scale=scale)
            builtin = _fa4_builtin(p, q, k, v, scale)
            ratios = []
            for _ in range(rounds):
                a, b = kernel_ms(ours, DEV), kernel_ms(builtin, DEV)
                ratios.append(b / a)
            rows.append({"scenario": sid, "d": d, "ratios": ratios, "median": statistics.median(ratios)})
            log(f"alternate {sid} d{d}: built-in / fa4 time median {rows[-1]['median']:.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {rounds} rounds)")  # fmt: skip
    res["alternate"] = rows


def part_flags(res, log, rounds=7):
    """S4 (causal chunks and non-causal canvases) on FA4's built-in kernel once per flag: as
    shipped (the longer walks first on a side stream), the same two launches back to back on one
    stream in either order, and the sparse path (the route before), in alternation with the
    built-in kernel on the causal twin; per round, pairs per time over the twin's."""
    sc = scenarios(1)["S4"]
    d, scale = 128, 128**-0.5
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    twin = sa.plan(sa.Batch([sa.Seq(s.q_len, kv_len=s.kv_len) for s in sc.batch.seqs]), sc.layer, device=DEV)
    q, k, v = rand_qkv(p, HQ, HKV, d, torch.bfloat16)
    launches = fa4._lowering(p, q, k)[0].calls  # longer walks first

    def one_stream(order):
        def run():
            out = torch.empty_like(q)
            for c in order:
                c(q, k, v, scale, 0.0, False, out=out)
            return out

        return run

    fns = {
        "fa4 (side stream)": functools.partial(fa4.forward, q, k, v, p, scale=scale),
        "one stream, longer walks first": one_stream(launches),
        "one stream, shorter walks first": one_stream(launches[::-1]),
        "sparse path": _sparse(p, q, k, v, scale),
    }
    truth = Truth(q, k, v, p, scale=scale)
    row = {"flags_first": [c.fixed["causal"] for c in launches], "check": {}}
    for name, fn in fns.items():
        for _ in range(3):  # recorded, checked, direct
            out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out = out[0] if out.dim() == 4 else out  # the sparse call's batch of 1
        row["check"][name] = truth.check(out, rounding_slack=True).as_dict()
    fns["built-in (twin)"] = _fa4_builtin(twin, q, k, v, scale)
    times = {n: [] for n in fns}
    for r in range(rounds):
        for n in rotated(list(fns), r):  # who goes first rotates
            times[n].append(kernel_ms(fns[n], DEV))
    light, twin_ms = twin.allowed_pairs() / p.allowed_pairs(), times["built-in (twin)"]
    for n, ms in times.items():
        row[n] = {"ms": statistics.median(ms), "rounds_ms": ms}
        if n != "built-in (twin)":  # per pair: the time ratio over the pairs' ratio
            row[n]["efficiency"] = statistics.median(t0 / t / light for t, t0 in zip(ms, twin_ms))
            log(f"flags S4: {n} {row[n]['ms']:.4f} ms, per pair {row[n]['efficiency']:.3f} of the built-in")
    res["flags"] = row


def _sparse(p, q, k, v, scale, tables=None):
    """The sparse path's FA4 call with the given tile tables (default: the plan's own)."""
    from flash_attn.cute import flash_attn_func

    t, aux = fa4.sparse_inputs(p, q.shape[-1])
    kw = {"softmax_scale": scale, "causal": False, "pack_gqa": fa4._pack_gqa(q, k)}
    kw |= {"mask_mod": fa4._interval_mask_mod(), "aux_tensors": aux}
    kw["block_sparse_tensors"] = fa4._block_sparse(tables or t)
    return lambda: flash_attn_func(q[None], k[None], v[None], **kw)


def _all_full(t):
    """The same visited tiles, every one listed FULL: FA4 then never evaluates the mask."""
    m, n = t.kv_indices.shape
    col = torch.arange(n, device=t.kv_indices.device)[None]
    seen = torch.zeros(m, n + 1, dtype=torch.bool, device=col.device)
    for cnt, idx in ((t.kv_num_blocks, t.kv_indices), (t.full_kv_num_blocks, t.full_kv_indices)):
        seen.scatter_(1, torch.where(col < cnt[:, None], idx.long(), n), True)
    grid = seen[:, :n].to(torch.int32)
    idx = torch.argsort(grid, dim=-1, descending=True, stable=True).to(torch.int32)
    return dataclasses.replace(
        t, kv_num_blocks=torch.zeros_like(t.kv_num_blocks), kv_indices=idx,
        full_kv_num_blocks=grid.sum(-1, dtype=torch.int32), full_kv_indices=idx,
    )  # fmt: skip


def part_anatomy(res, log, rounds=7):
    """S1's sparse path taken apart, each variant timed in alternation with FA4's built-in."""
    sc = scenarios(1)["S1"]
    rows = []
    for d in sc.head_dims:
        p = sa.plan(sc.batch, sc.layer, device=DEV)
        plain = sa.plan(sc.batch, sa.LayerMask(window=sc.layer.window, spans="off"), device=DEV)
        q, k, v = rand_qkv(p, HQ, HKV, d, torch.bfloat16)
        scale = d**-0.5
        fns = {
            "fa4 (ours), S1 mask": _sparse(p, q, k, v, scale),
            "sparse path, plain window mask": _sparse(plain, q, k, v, scale),
            "sparse path, plain window, mask never evaluated": _sparse(
                plain, q, k, v, scale, _all_full(fa4.sparse_inputs(plain, d)[0])
            ),
            "sparse path, S1 tiles, mask never evaluated": _sparse(
                p, q, k, v, scale, _all_full(fa4.sparse_inputs(p, d)[0])
            ),
        }
        builtin = _fa4_builtin(p, q, k, v, scale)
        row = {"d": d}
        for name, fn in fns.items():
            ratios = []
            for _ in range(rounds):
                a, b = kernel_ms(fn, DEV), kernel_ms(builtin, DEV)
                ratios.append(b / a)
            row[name] = {"ratios": ratios, "median": statistics.median(ratios)}
            log(f"anatomy S1 d{d} {name}: built-in / this time {row[name]['median']:.3f}")
        rows.append(row)
    res["anatomy"] = rows


def mixed_step():
    """A serving step: two prefill chunks with images, 64 decode rows, four diffusion canvases."""
    rnd = random.Random(3)
    seqs = [sa.Seq(q_len=2048, kv_len=kv, spans=[(kv - 1500, kv - 400)]) for kv in (6000, 9000)]
    seqs += [sa.Seq(q_len=1, kv_len=rnd.randint(4096, 16384)) for _ in range(64)]
    seqs += [sa.Seq(q_len=256, kv_len=2048, causal=False) for _ in range(4)]
    return sa.Batch(seqs)


def part_mixed(res, log):
    """fa4 (each sequence on its own query tiles) against triton on a mixed serving step, both
    checked against fp64 truth at this size first."""
    rows = []
    for layer in (sa.LayerMask(spans="on"), sa.LayerMask(window=1024, spans="clamp")):
        p = sa.plan(mixed_step(), layer, device=DEV)
        q, k, v = rand_qkv(p, HQ, HKV, 128, torch.bfloat16)
        truth = Truth(q, k, v, p, scale=128**-0.5)
        row = {"layer": repr(layer), "total_q": p.total_q, "total_k": p.total_k}
        for name, fwd in (("fa4", fa4.forward), ("triton", tb.forward)):
            run = functools.partial(fwd, q, k, v, p, scale=128**-0.5)
            row[name] = {"check": truth.check(run()[0], rounding_slack=True).as_dict()}
            row[name]["ms"] = kernel_ms(run, DEV)
        rows.append(row)
        log(f"mixed {row}")
    res["mixed"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,count,bench")
    ap.add_argument("--scenarios", default="S0,S1,S2,S3,S4")
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--quick", action="store_true", help="check: d128 bf16 GQA 2 only")
    ap.add_argument("--rounds", type=int, default=9, help="alternate: rounds per scenario")
    args = ap.parse_args()
    import flash_attn

    res = {
        **environment("cuda"),
        "flash_attn_4": getattr(flash_attn, "__version__", "?"),
    }
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    ids = args.scenarios.split(",")
    parts = {
        "check": lambda r, lg: part_check(r, lg, args.quick),
        "count": part_count,
        "bench": lambda r, lg: part_bench(r, lg, ids),
        "mixed": part_mixed,
        "alternate": lambda r, lg: part_alternate(r, lg, ids, args.rounds),
        "anatomy": part_anatomy,
        "flags": lambda r, lg: part_flags(r, lg, args.rounds),
    }
    path = result_path(args.out, "fa4", res)
    for name in args.parts.split(","):
        parts[name](res, log)
        path.write_text(json.dumps(res, indent=1))  # after every part: a cut-short run keeps them
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
