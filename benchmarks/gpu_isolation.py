"""What keeping sequences apart costs, on one GPU in one call.

    python benchmarks/gpu_isolation.py --out results/ [--rounds 5] [--scenarios S0,S1,S2,S3,S4]

FlexAttention and FA4's sparse path see a step as one packed sequence on a fixed tile grid; a
tile that straddles two sequences multiplies a neighbour's NaN/Inf values by probability 0 and
makes NaN. The backends therefore run in the aligned layout (spanattn/aligned.py), copying q/k/v
when a sequence is not a whole number of tiles, and ``backend="auto"`` leaves such steps to
triton. Per scenario this times, in alternating rounds with calls back to back:

- the fa4 and flex backends as shipped (isolated) against the same kernels on the packed layout
  (``packed``: what they ran before, not isolated: not a backend anyone can pick);
- triton and ``auto`` (and which backend auto picked), and FA4's built-in causal/window kernel
  (the speed of light: it ignores spans).

Each row also says whether the isolated call copied anything. Writes <date>-isolation-<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import spanattn as sa
from spanattn.backends import fa4, flex
from spanattn.bench.report import environment, result_path
from spanattn.bench.timing import kernel_ms
from spanattn.scenarios import HKV, HQ, scenarios
from spanattn.tiles import tile_tables

DEV = "cuda"


def _fa4_packed(p, q, k, v, scale):
    """FA4's sparse path on the packed layout (the tables of tiles.py), queries tile-aligned."""
    from flash_attn.cute import flash_attn_func

    block_n = fa4._kv_tile(q.shape[-1], p.layer.window is not None)
    alo, ahi = p.packed_intervals()
    size = (-(-p.total_q // fa4.BLOCK_M) + 1) * fa4.BLOCK_M
    lo = torch.full((size,), fa4.EMPTY_LO, dtype=torch.int32, device=DEV)
    width = torch.zeros(size, dtype=torch.int32, device=DEV)
    lo[: p.total_q], width[: p.total_q] = alo, ahi - alo
    t = tile_tables(p, fa4.BLOCK_M, block_n)
    kw = dict(causal=False, pack_gqa=fa4._pack_gqa(q, k), mask_mod=fa4._interval_mask_mod())
    kw |= dict(aux_tensors=[lo, width], block_sparse_tensors=fa4._block_sparse(t), softmax_scale=scale)
    return lambda: flash_attn_func(q[None], k[None], v[None], **kw)


def _flex_packed(p, q, k, v, scale):
    t = tile_tables(p, flex.BLOCK_M, flex.BLOCK_N)
    alo, ahi = p.packed_intervals()
    step = flex._compiled(False)
    return lambda: flex._call(step, q, k, v, alo, ahi, t, scale, None, False)


def _builtin(p, q, k, v, scale):
    from flash_attn.cute import flash_attn_varlen_func

    w = p.layer.window
    kw = dict(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q)
    kw |= dict(max_seqlen_k=p.max_seqlen_k, softmax_scale=scale, causal=True)
    kw |= dict(window_size=(None, None) if w is None else (w - 1, 0))
    return lambda: flash_attn_varlen_func(q, k, v, **kw)


def bench(sid, sc, d, rounds, log):
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device=DEV, dtype=torch.bfloat16, generator=g)
               for n, h in ((p.total_q, HQ), (p.total_k, HKV), (p.total_k, HKV)))  # fmt: skip
    scale, flops = d**-0.5, 4 * d * HQ * p.allowed_pairs()
    fns = {
        "auto": lambda: sa.attention(q, k, v, p, scale=scale),
        "triton": lambda: sa.attention(q, k, v, p, backend="triton", scale=scale),
        "fa4": lambda: sa.attention(q, k, v, p, backend="fa4", scale=scale),
        "FA4 built-in (no spans)": _builtin(p, q, k, v, scale),
    }
    if not fa4.builtin(p):
        fns["fa4 packed (not isolated)"] = _fa4_packed(p, q, k, v, scale)
    if d <= 256:
        fns["flex"] = lambda: sa.attention(q, k, v, p, backend="flex", scale=scale)
        fns["flex packed (not isolated)"] = _flex_packed(p, q, k, v, scale)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(kernel_ms(fn, DEV))
    row = {
        "scenario": sid,
        "d": d,
        "auto_picks": sa.auto_choice(q, p),
        "fa4_path": "builtin" if fa4.builtin(p) else "sparse",
    }
    row["fa4_copies"] = fa4.copies(p, d)
    row["flex_copies"] = flex.aligned_layout(p, flex.BLOCK_M, flex.BLOCK_N).copies
    for name, ts in times.items():
        ms = statistics.median(ts)
        row[name] = {
            "ms": round(ms, 4),
            "tflops": round(flops / ms / 1e9, 1),
            "rounds": [round(t, 4) for t in ts],
        }
    log(f"{sid} d{d}: " + ", ".join(f"{n} {row[n]['ms']:.3f}" for n in fns) + f" (auto: {row['auto_picks']})")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scenarios", default="S0,S1,S2,S3,S4")
    args = ap.parse_args()
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)
    import flash_attn

    res = {**environment(DEV), "flash_attn_4": getattr(flash_attn, "__version__", "?"), "rows": []}
    for sid, sc in scenarios(1).items():
        if sid in args.scenarios.split(","):
            for d in (x for x in sc.head_dims if x <= 256):
                res["rows"].append(bench(sid, sc, d, args.rounds, log))
    path = result_path(args.out, "isolation", res)
    path.write_text(json.dumps(res, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
