"""Compile the backward kernels (kernel_dkdv.py, kernel_dq.py) for sm_90 on any machine (no GPU
needed) and print what ptxas reports per head_dim and config: registers per thread, spills,
shared memory. compile_stats.py's filter for the forward, for the backward's tiles
(configs.BACKWARD_CONFIGS): a config that spills rarely wins the timing.

    python tools/kernel_lab/compile_stats_backward.py                     # every shipped config, bf16
    python tools/kernel_lab/compile_stats_backward.py --dims 128 --groups clamp --softcap
    python tools/kernel_lab/compile_stats_backward.py --fp32                              # fp32's tiles
    python tools/kernel_lab/compile_stats_backward.py --dims 128 --dkdv 32,64,8,2 --dq 64,64,8,2
    python tools/kernel_lab/compile_stats_backward.py --gluon    # the Gluon kernels, one JSON line a variant

A config is BLOCK_M,BLOCK_N,num_warps,num_stages[,dv_split]; arguments are specialized as a real
launch's (16-divisible pointers and strides, Hq 16 / Hkv 8).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_stats import _report, divisible, sass  # noqa: E402

from spanattn.backends.triton import kernel_dkdv, kernel_dq  # noqa: E402
from spanattn.backends.triton.columns import INFO, KEY_INFO  # noqa: E402
from spanattn.backends.triton.configs import Config, padded_head_dim, pick_backward  # noqa: E402

FLOATS = {name: "*bf16" for name in ("Q", "K", "V", "DO", "DQ", "DK", "DV")}
FLOATS.update(
    {"LSE2": "*fp32", "DELTA": "*fp32", "qk_scale": "fp32", "softcap_log2": "fp32", "scale": "fp32"}
)


def stats(fn, cfg: Config, d: int, n_info: int, groups: str, softcap: bool, fp32: bool = False) -> dict:
    sig = {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        if param.annotation is not inspect.Parameter.empty:
            sig[name] = "constexpr"
        else:
            sig[name] = FLOATS.get(name, "i32" if name.startswith("stride_") else "*i32")
            sig[name] = sig[name].replace("bf16", "fp32") if fp32 else sig[name]
    const = {
        "HQ": 16, "GROUP": 2, "HEAD_DIM": padded_head_dim(d), "D": d, "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n, "SPLIT": cfg.dv_split, "SOFTCAP": softcap,
        "DOT_PRECISION": "ieee" if fp32 else "tf32", "WHILE_LOOPS": False, "N_INFO": n_info,
        "GROUPS": bool(groups), "CLAMP": groups == "clamp",
    }  # fmt: skip
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=divisible(sig))
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    # Hopper's wgmma needs 64 rows a warpgroup; smaller tiles get the older mma instructions
    return {**_report(kernel), "wgmma": "HGMMA" in sass(kernel.asm["cubin"])}


def _gluon_report(fn, cols: int, q_rows: int, kv_rows: int, const: dict) -> dict:
    """Compile Gluon kernel ``fn`` for sm_90 with bf16 descriptors of ``q_rows`` (q, dO) and
    ``kv_rows`` (K, V) x ``cols`` boxes, Hq 16 / Hkv 8 and ``const``, and report."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from spanattn.backends.triton import gluon_parts as parts

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {cols}],{layout!r}>"

    sig = {}
    for name, param in inspect.signature(fn.fn).parameters.items():
        if param.annotation is not inspect.Parameter.empty:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):
            sig[name] = desc(kv_rows if name in ("k_desc", "v_desc") else q_rows)
        elif name.startswith("stride_") or "_head_" in name:
            sig[name] = "i32"
        else:
            sig[name] = FLOATS.get(name, "*i32")
    const = {"HQ": 16, "GROUP": 2, "CONSUMER_REGS": parts.CONSUMER_REGS, "PRODUCER_REGS": parts.PRODUCER_REGS,
             **const}  # fmt: skip
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=divisible(sig))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return {**_report(kernel), "wgmma": "HGMMA" in sass(kernel.asm["cubin"])}


def gluon_stats(d: int, softcap: bool = False) -> dict:
    """kernel_gluon_dkdv's report at head_dim ``d`` (its split form at d256 and d512)."""
    from spanattn.backends.triton import kernel_gluon_dkdv as g
    from spanattn.backends.triton import kernel_gluon_dkdv_split as split

    block_m, block_n, stages = g.TILES[d]
    fn, cols = (g.attn_bwd_dkdv_gluon, d) if d == 128 else (split.attn_bwd_dkdv_gluon_split, 128)
    const = {"HEAD_DIM": d, "BLOCK_M": block_m, "STAGES": stages, "SOFTCAP": softcap, "N_INFO": len(KEY_INFO)}
    return _gluon_report(fn, cols, block_m, block_n, const)


def gluon_dq_stats(d: int, softcap: bool = False) -> dict:
    """kernel_gluon_dq's report at head_dim ``d`` (its split form at d512)."""
    from spanattn.backends.triton import kernel_gluon_dq as g
    from spanattn.backends.triton import kernel_gluon_dq_split as split

    _, block_n, stages = g.TILES[d]
    fn, cols = (split.attn_bwd_dq_gluon_split, 128) if d == 512 else (g.attn_bwd_dq_gluon, d)
    const = {"HEAD_DIM": d, "BLOCK_N": block_n, "STAGES": stages, "SOFTCAP": softcap, "N_INFO": len(INFO)}
    return _gluon_report(fn, cols, g.ROWS.value, block_n, const)


REPORTED = ("shared_bytes", "ptxas", "wgmma_serialized", "wgmma_wait_injected", "wgmma")


def config(text: str) -> Config:
    """``BLOCK_M,BLOCK_N,num_warps,num_stages[,dv_split]``."""
    bm, bn, warps, stages, *split = (int(x) for x in text.split(","))
    return Config(bm, bn, warps, stages, dv_split=split[0] if split else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="16,32,64,128,256,512")
    ap.add_argument("--dkdv", type=config, help="instead of the shipped dK/dV config")
    ap.add_argument("--dq", type=config, help="instead of the shipped dQ config")
    ap.add_argument("--groups", default="", choices=["", "on", "clamp"])
    ap.add_argument("--softcap", action="store_true")
    ap.add_argument("--fp32", action="store_true", help="fp32 inputs (pick_backward's fp32 tiles)")
    ap.add_argument("--gluon", action="store_true", help="Gluon kernels, softcap off/on")
    args = ap.parse_args()
    if args.gluon:
        from spanattn.backends.triton.kernel_gluon_dkdv import HEAD_DIMS

        for kernel, stats_of in (("dkdv", gluon_stats), ("dq", gluon_dq_stats)):
            for d in HEAD_DIMS:
                for softcap in (False, True):
                    r = stats_of(d, softcap)
                    row = {"kernel": kernel, "d": d, "softcap": softcap, **{k: r[k] for k in REPORTED}}
                    print(json.dumps(row), flush=True)
        return
    print("kernel d (block_m, block_n, warps, stages, split) shared_bytes wgmma registers spill_stores_bytes")
    for d in (int(x) for x in args.dims.split(",")):
        dkdv, dq = pick_backward(d, torch.float32 if args.fp32 else torch.bfloat16, False)
        for name, fn, cfg, n_info in (("dkdv", kernel_dkdv.attn_bwd_dkdv, args.dkdv or dkdv, len(KEY_INFO)),
                                      ("dq", kernel_dq.attn_bwd_dq, args.dq or dq, len(INFO))):  # fmt: skip
            r = stats(fn, cfg, d, n_info, args.groups, args.softcap, args.fp32)
            ptxas = " ".join(r["ptxas"])
            regs = re.search(r"Used (\d+) registers", ptxas).group(1)
            spills = re.search(r"(\d+) bytes spill stores", ptxas).group(1)
            shape = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.dv_split)
            print(name, d, shape, r["shared_bytes"], r["wgmma"], regs, spills, flush=True)


if __name__ == "__main__":
    main()
