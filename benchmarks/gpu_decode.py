"""Check and time the split-KV decode kernel on one GPU in one call.

    python benchmarks/gpu_decode.py --out results/     # writes results/<date>-decode-<gpu>.json

check: small paged decode batches (q_len 1..16, GQA, windows, spans, canvases, softcap, pages
    16 and 128) with NaN in every cache slot no sequence owns and NaN-poisoned outputs, against
    fp64 truth: err(kernel) <= 2 * err(same-dtype reference) + 1e-4; no host sync inside.
D1: 64 seqs, q_len 1, kv 4k..32k, page 16, Hq 16 / Hkv 8, bf16, d128 and d256, pages scattered
    over the cache. Checked with the same rule, then timed (CUDA events, median) against SDPA on
    padded contiguous K/V with a key-padding mask. Bandwidth = K+V bytes the step must read
    (sum kv_len * Hkv * D * 2 * 2) / time, for every method; the ceiling is a device-to-device
    copy (bytes read + written) measured in the same call.
graph: a CUDA graph captured on one D1 step replays two other steps (new lengths, some longer,
    same shapes) correctly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spanattn as sa  # noqa: E402
from spanattn.backends.triton import decode  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.cache import gather_kv  # noqa: E402
from spanattn.oracle import Truth  # noqa: E402
from spanattn.scenarios import HKV, HQ, scenarios  # noqa: E402

DEV = os.environ.get("SPANATTN_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1: a smoke run
NAN = float("nan")


def scattered_cache(lens, hkv, d, page, dtype, width=None, seed=0):
    """Caches where each sequence owns ``width`` randomly placed blocks; all other slots NaN."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    width = width or -(-max(lens) // page)
    n = len(lens) * width
    bt = torch.randperm(n, device=DEV, generator=g).int().view(len(lens), width)
    kc = torch.full((n, page, hkv, d), NAN, dtype=dtype, device=DEV)
    vc = torch.full_like(kc, NAN)
    p = sa.plan(sa.Batch([sa.Seq(q_len=x) for x in lens]), sa.LayerMask(), device=DEV)
    k = torch.randn(p.total_k, hkv, d, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(p.total_k, hkv, d, device=DEV, dtype=dtype, generator=g)
    sa.write_kv_cache(k, v, kc, vc, sa.cache.slot_mapping(p, bt, page))
    return kc, vc, bt


def sync_debug(mode):
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


def rule(out, lse, q, kc, vc, bt, p, scale, softcap=None):
    """The rule of docs/design.md section 4 (spanattn.oracle) for out and LSE, against the pages
    gathered back."""
    return Truth(q, kc, vc, p, scale=scale, softcap=softcap, block_table=bt).check(out, lse).as_dict()


def check(report):
    cases = []
    mixed = [
        sa.Seq(q_len=1, kv_len=3001),
        sa.Seq(q_len=4, kv_len=700, spans=[(650, 699)]),
        sa.Seq(q_len=16, kv_len=2048, causal=False),
        sa.Seq(q_len=1, kv_len=1),
        sa.Seq(q_len=8, kv_len=5000, spans=[(4990, 4999)]),
    ]
    for d, dtype, page, layer, hq, hkv, softcap in [
        (128, torch.bfloat16, 16, sa.LayerMask(), 16, 8, None),
        (256, torch.bfloat16, 16, sa.LayerMask(window=512, spans="clamp"), 16, 2, None),
        (128, torch.float16, 128, sa.LayerMask(window=1024, spans="on"), 8, 1, 30.0),
        (64, torch.bfloat16, 32, sa.LayerMask(spans="on"), 4, 4, None),
        (512, torch.bfloat16, 16, sa.LayerMask(window=700, spans="clamp"), 8, 2, None),
    ]:
        p = sa.plan(sa.Batch(mixed), layer, device=DEV)
        kc, vc, bt = scattered_cache([s.kv_len for s in mixed], hkv, d, page, dtype)
        q = torch.randn(p.total_q, hq, d, device=DEV, dtype=dtype)
        for split_keys in (None, 256, 10**9):
            out = torch.full_like(q, NAN)
            sync_debug("error")  # any host sync inside raises
            try:
                out, lse = decode.decode_forward(
                    q, kc, vc, p, scale=d**-0.5, softcap=softcap, return_lse=True, block_table=bt,
                    split_keys=split_keys, out=out,
                )  # fmt: skip
            finally:
                sync_debug(0)
            r = rule(out, lse, q, kc, vc, bt, p, d**-0.5, softcap)
            r.update(
                d=d, dtype=str(dtype), page=page, layer=repr(layer), hq=hq, hkv=hkv, split_keys=split_keys
            )
            cases.append(r)
        # the public path: attention(..., block_table=...) on the triton backend
        try:
            o2, l2 = sa.attention(
                q, kc, vc, p, block_table=bt, backend="triton", softcap=softcap, return_lse=True
            )
            cases[-1]["api_triton"] = rule(o2, l2, q, kc, vc, bt, p, d**-0.5, softcap)
        except Exception as e:
            cases[-1]["api_triton"] = {"error": repr(e)[:300]}
    report["check"] = {"ok": all(c["ok"] for c in cases), "cases": cases}
    print("check:", "PASS" if report["check"]["ok"] else "FAIL", f"({len(cases)} cases)", flush=True)


def sdpa_padded(q, k, v, lens, maxlen, hkv, d):
    """SDPA's peer form: K/V padded to the longest sequence, a key-padding mask."""
    n = len(lens)
    kp = torch.zeros(n, hkv, maxlen, d, device=DEV, dtype=q.dtype)
    vp = torch.zeros_like(kp)
    off = 0
    for i, x in enumerate(lens):
        kp[i, :, :x] = k[off : off + x].transpose(0, 1)
        vp[i, :, :x] = v[off : off + x].transpose(0, 1)
        off += x
    mask = (torch.arange(maxlen, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None])[
        :, None, None
    ]
    qs = q.view(n, 1, HQ, d).transpose(1, 2)
    eff = torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION

    def gqa():
        with torch.nn.attention.sdpa_kernel(eff):
            return F.scaled_dot_product_attention(qs, kp, vp, attn_mask=mask, enable_gqa=True)

    try:
        gqa()
        return gqa, "efficient attention, enable_gqa"
    except Exception:  # no GQA in this kernel: expand K/V (reads them twice: SDPA's cost)
        ke, ve = kp.repeat_interleave(HQ // hkv, 1), vp.repeat_interleave(HQ // hkv, 1)
        del kp, vp
        return lambda: F.scaled_dot_product_attention(qs, ke, ve, attn_mask=mask), "default, K/V expanded"


def d1(report, d, configs, split_grid):
    sc = scenarios()["D1"]
    lens = [s.kv_len for s in sc.batch.seqs]
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    kc, vc, bt = scattered_cache(lens, HKV, d, sc.page_size, torch.bfloat16, seed=d)
    q = torch.randn(p.total_q, HQ, d, device=DEV, dtype=torch.bfloat16)
    nbytes = sum(lens) * HKV * d * 2 * 2
    res = {"kv_bytes": nbytes, "auto_splits": decode.choose_splits(p, HKV, DEV)}
    out, lse = decode.decode_forward(q, kc, vc, p, scale=d**-0.5, return_lse=True, block_table=bt)
    res["check"] = rule(out, lse, q, kc, vc, bt, p, d**-0.5)
    tbs = lambda ms: nbytes / ms / 1e9
    sweep = []
    for cfg in configs:
        for sk in split_grid:
            f = lambda sk=sk, cfg=cfg: decode.decode_forward(
                q, kc, vc, p, scale=d**-0.5, block_table=bt, split_keys=sk, config=cfg
            )
            try:
                ms = do_bench(f, warmup=10, rep=60, return_mode="median")
                sweep.append({"config": cfg, "split_keys": sk, "ms": ms, "TB/s": tbs(ms)})
            except Exception as e:  # a config that does not fit (shared memory) is skipped
                sweep.append({"config": cfg, "split_keys": sk, "error": repr(e)[:200]})
    res["sweep"] = sweep
    auto = lambda: decode.decode_forward(q, kc, vc, p, scale=d**-0.5, block_table=bt)
    ms = do_bench(auto, warmup=10, rep=100, return_mode="median")
    res["ours_auto"] = {"ms": ms, "TB/s": tbs(ms), "config": decode._config(d)}
    timed = [s for s in sweep if "ms" in s]
    res["ours_best"] = min(timed, key=lambda s: s["ms"]) if timed else None
    try:
        k, v = gather_kv(kc, vc, bt, p)
        f, how = sdpa_padded(q, k, v, lens, max(lens), HKV, d)
        want = f().transpose(1, 2).reshape(q.shape)
        res["sdpa_max_diff_vs_ours"] = (want.float() - out.float()).abs().max().item()
        del k, v
        ms = do_bench(f, warmup=5, rep=60, return_mode="median")
        res["sdpa_padded_mask"] = {"ms": ms, "TB/s": tbs(ms), "how": how}
    except Exception as e:
        res["sdpa_padded_mask"] = {"error": repr(e)[:300]}
    report[f"D1_d{d}"] = res
    best = res["ours_best"] or {}
    print(
        f"D1 d{d}: auto {res['ours_auto']['TB/s']:.2f} TB/s ({res['ours_auto']['ms']:.3f} ms, splits "
        f"{res['auto_splits']}), best {best.get('TB/s', 0):.2f} TB/s {best.get('config')} "
        f"split_keys={best.get('split_keys')}, sdpa {res['sdpa_padded_mask'].get('TB/s', 0):.2f} TB/s, "
        f"check {'PASS' if res['check']['ok'] else 'FAIL'}",
        flush=True,
    )


def graph(report, d=128):
    """Capture on one step, replay two others with new lengths (some longer) in the same buffers."""
    sc = scenarios()["D1"]
    lens0 = [s.kv_len for s in sc.batch.seqs]
    g = torch.Generator().manual_seed(7)
    width = -(-(max(lens0) + 4096) // sc.page_size)
    steps = [lens0] + [
        [max(1, x + int(dx)) for x, dx in zip(lens0, torch.randint(-3000, 4000, (64,), generator=g))]
        for _ in (1, 2)
    ]
    kc, vc, bt = scattered_cache(
        [width * sc.page_size] * 64, HKV, d, sc.page_size, torch.bfloat16, width=width
    )
    mk = lambda lens: sa.plan(sa.Batch([sa.Seq(q_len=1, kv_len=x) for x in lens]), sc.layer, device=DEV)
    p = mk(steps[0])
    q = torch.randn(p.total_q, HQ, d, device=DEV, dtype=torch.bfloat16)
    run = lambda: decode.decode_forward(q, kc, vc, p, scale=d**-0.5, return_lse=True, block_table=bt)
    run()
    torch.cuda.synchronize()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        out, lse = run()
    results = []
    for lens in steps[1:]:
        new = mk(lens)
        for name in ("lo", "hi", "seq_lens", "cu_seqlens_q", "cu_seqlens_k"):
            getattr(p, name).copy_(getattr(new, name))
        q.copy_(torch.randn_like(q))
        cg.replay()
        torch.cuda.synchronize()
        results.append(rule(out, lse, q, kc, vc, bt, new, d**-0.5))
    ms = do_bench(cg.replay, warmup=5, rep=50, return_mode="median")
    report["graph"] = {"ok": all(r["ok"] for r in results), "steps": results, "replay_ms": ms}
    print(f"graph: {'PASS' if report['graph']['ok'] else 'FAIL'}, replay {ms:.3f} ms", flush=True)


def copy_rate(report):
    x = torch.empty(4 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
    report["copy_TB/s"] = 2 * x.numel() / ms / 1e9
    print(f"device-to-device copy: {report['copy_TB/s']:.2f} TB/s (read + written)", flush=True)


SPLIT_GRID = [None, 1024, 2048, 4096, 8192, 10**9]  # None = automatic; 10**9 = one program a sequence


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--parts", default="copy,check,d1_128,d1_256,graph")
    ap.add_argument("--quick", action="store_true", help="time the default config only, no sweep")
    args = ap.parse_args()
    report = {
        **environment(DEV),
        "bandwidth_rule": "K+V bytes the step must read (sum kv_len * Hkv * D * 2 B * 2) / time",
    }
    sweep_128 = [(64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 8, 2), (64, 8, 3)], SPLIT_GRID
    sweep_256 = [(32, 4, 3), (32, 4, 4), (64, 4, 2), (16, 4, 4), (64, 8, 2)], SPLIT_GRID
    if args.quick:
        sweep_128 = sweep_256 = [None], [2048]
    path = result_path(args.out, "decode", report)
    parts = {
        "copy": copy_rate,
        "check": check,
        "d1_128": lambda r: d1(r, 128, *sweep_128),
        "d1_256": lambda r: d1(r, 256, *sweep_256),
        "graph": graph,
    }
    for name in args.parts.split(","):
        try:
            parts[name](report)
        except Exception:
            report[f"{name}_error"] = traceback.format_exc()[-2000:]
            print(report[f"{name}_error"], flush=True)
        torch.cuda.empty_cache()
        path.write_text(json.dumps(report, indent=1))  # after every part: a cut-short run keeps them
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
