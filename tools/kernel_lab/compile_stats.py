"""Compile the prefill kernel for sm_90 on any machine (no GPU needed) and print, per tile
config, what ptxas reports: registers per thread, spills, shared memory, and whether wgmma
instructions get serialized (ptxas C7514/C7515) or waited for (C7517); from the SASS, how many
exponentials of each loop's softmax run under its P @ V (gluon_pv_wait.py). A cheap first filter
before spending device time on a config: a config that spills or serializes its MMAs rarely
wins the timing.

    python tools/kernel_lab/compile_stats.py --d 128 --configs 128,64,4,2,1,1,1 128,128,8,3,0,1,1
    python tools/kernel_lab/compile_stats.py --d 128 --paged 128 --configs 128,64,4,2,1,1,0
    python tools/kernel_lab/compile_stats.py --d 128 --groups on --configs 128,128,8,3,0,1,1  # span groups
    python tools/kernel_lab/compile_stats.py --d 256 --configs 128,64,8,2,1,1,1,1   # a Gluon kernel
    python tools/kernel_lab/compile_stats.py --d 512 --paged 16 --configs 64,32,8,2,0,1,1,1  # over pages
    python tools/kernel_lab/compile_stats.py --shipped   # every variant configs.pick(_gluon) hands out

A config is BLOCK_M,BLOCK_N,num_warps,num_stages,one_loop,dv_split,tma,gluon,persistent (configs.Config's
order; trailing fields may be left out). With gluon set, the Gluon kernel for head_dim and
BLOCK_M (the triton backend's GLUON_KERNELS) is compiled instead, at BLOCK_N and num_stages (its
warps are fixed; ptxas reports the launch's registers per thread, which its consumer warps raise
to 240 with setmaxnreg); with --paged, its producer reads pages of that size.
Arguments are specialized as in a real launch (16-divisible pointers and strides, bf16, Hq 16 /
Hkv 8); triton's own ptxas does the assembling. 2026-11-29 on the H200's defaults: d128 4 warps
255 registers + 116 B spilled, two programs per SM (97 KB shared); d128 8 warps 198-223, no
spill; d512 split columns 198, no spill, 224 KB; d512 64 x 32 unsplit serializes its wgmma.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from spanattn.backends.triton import GLUON_KERNELS
from spanattn.backends.triton import kernel as tk
from spanattn.backends.triton.columns import INFO
from spanattn.backends.triton.configs import Config, pick, pick_gluon

FP_ARGS = ("Q", "K", "V", "K_DESC", "V_DESC", "OUT", "LSE")
SCALAR_FP = ("qk_scale", "softcap_log2")
# runtime scalars exempt from specialization (do_not_specialize)
SCALAR_INT = ("last_page", "num_items", "section", "halves")


def signature() -> dict[str, str]:
    """attn_fwd's argument types as a real bf16 launch passes them."""
    sig = {}
    for name, param in inspect.signature(tk.attn_fwd.fn).parameters.items():
        if param.annotation is not inspect.Parameter.empty:
            sig[name] = "constexpr"
        elif name in FP_ARGS:
            sig[name] = "*bf16"
        elif name in SCALAR_FP:
            sig[name] = "fp32"
        elif name.startswith("stride_") or name in SCALAR_INT:
            sig[name] = "i32"
        else:
            sig[name] = "*i32"
    return sig


def divisible(sig: dict[str, str]) -> dict:
    """The specialization a real launch gets: every pointer and integer but the
    ``do_not_specialize`` scalars a multiple of 16 (16-byte aligned tensors, strides of head_dims
    and head counts), which lets the compiler vectorize loads and stores."""
    runtime = [
        i for i, (name, t) in enumerate(sig.items())
        if t not in ("constexpr", "fp32") and "desc" not in t and name not in SCALAR_INT
    ]  # fmt: skip
    return {(i,): [["tt.divisibility", 16]] for i in runtime}


def stats(cfg: Config, d: int, paged: int = 0, groups: str = "") -> dict:
    """``groups``: "" (no span groups), "on" or "clamp" (kernel.py's GROUPS and CLAMP)."""
    sig = signature()
    if cfg.tma and not paged:  # host descriptors of K and V
        sig["K_DESC"] = f"tensordesc<bf16[{cfg.block_n}, {d}]>"
        sig["V_DESC"] = f"tensordesc<bf16[{cfg.block_n}, {d // cfg.dv_split}]>"
    const = {
        "HQ": 16, "GROUP": 2, "HEAD_DIM": d, "D": d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "SOFTCAP": False, "RETURN_LSE": False, "PAGED": bool(paged), "PAGE_SIZE": paged or 1,
        "DOT_PRECISION": "tf32", "WHILE_LOOPS": False, "ONE_LOOP": cfg.one_loop,
        "DV_SPLIT": cfg.dv_split, "TMA": cfg.tma and not paged, "N_INFO": len(INFO),
        "GROUPS": bool(groups), "CLAMP": groups == "clamp",
    }  # fmt: skip
    src = ASTSource(fn=tk.attn_fwd, signature=sig, constexprs=const, attrs=divisible(sig))
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return _report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts))


def gluon_stats(cfg: Config, d: int, page: int = 0, groups: str = "") -> dict:
    import importlib

    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from spanattn.backends.triton import gluon_parts as parts

    module = importlib.import_module("spanattn.backends.triton." + GLUON_KERNELS[(d, cfg.block_m)])
    kernel = next(v for k, v in vars(module).items() if k.startswith("attn_fwd_gluon"))
    width = d // 2 if "split" in module.__name__ else d  # boxes of half the head_dim

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {width}],{layout!r}>"

    sig = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if param.annotation is not inspect.Parameter.empty:
            sig[name] = "constexpr"
        elif name.endswith("_desc"):
            sig[name] = desc(module.ROWS.value if name == "q_desc" else min(page or cfg.block_n, cfg.block_n))
        else:
            scalar = name.startswith("stride_") or "_head_" in name or name in SCALAR_INT
            typed = {"OUT": "*bf16", "LSE": "*fp32", "WS": "*fp32", "qk_scale": "fp32"}
            sig[name] = {**typed, "softcap_log2": "fp32"}.get(name, "i32" if scalar else "*i32")
    const = {
        "HQ": 16, "GROUP": 2, "HEAD_DIM": d, "BLOCK_N": cfg.block_n, "STAGES": cfg.num_stages,
        "SOFTCAP": False, "RETURN_LSE": False, "N_INFO": len(INFO), "PAGE": page,
        "GROUPS": bool(groups), "CLAMP": groups == "clamp", "CONSUMER_REGS": parts.CONSUMER_REGS,
        "PRODUCER_REGS": parts.PRODUCER_REGS,
    }  # fmt: skip
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=const, attrs=divisible(sig))
    return _report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))


def ptxas_path() -> str:
    """The ptxas triton itself uses for sm_90 (its own binary, or a newer one later versions
    pick or TRITON_PTXAS_PATH names)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def _report(kernel) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = ptxas_path()
    cmd = [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull]
    log = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(f.name)
    code = sass(kernel.asm["cubin"])
    info = [line.split("info    : ")[-1].strip() for line in log.stderr.splitlines()]
    return {
        "shared_bytes": kernel.metadata.shared,
        "ptxas": [x for x in info if ("registers" in x or "spill" in x) and "(C75" not in x],
        "wgmma_serialized": "are serialized" in log.stderr,
        "wgmma_wait_injected": "C7517" in log.stderr,
        "exps_under_pv": exps_under_pv(code),
        "rescales_under_scores": rescales_under_scores(code),
    }


def sass(cubin: bytes) -> str:
    """The cubin's SASS, by the cuobjdump that ships with triton."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def exps_under_pv(sass_text: str) -> list[int]:
    """Per wait for every wgmma that follows a wait leaving one group in flight (a Gluon loop's
    P @ V, issued after its tile's Q @ K^T): the exponentials (MUFU.EX2) between the two waits,
    i.e. how much of the softmax runs under that P @ V (gluon_pv_wait.py). The SASS order is
    ptxas's, which moves a wgmma wait to the start of its basic block."""
    counts, exps = [], None
    for line in sass_text.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            exps = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and exps is not None:
            counts.append(exps)
            exps = None
        elif "MUFU.EX2" in line and exps is not None:
            exps += 1
    return counts


def rescales_under_scores(sass_text: str) -> list[int]:
    """Per Q @ K^T issue of kernel_gluon's loop (shared-memory operands: ``HGMMA R, gdesc``) that
    a P @ V issue follows (a register operand: ``HGMMA R, R, gdesc``) before any wait: the
    multiplies (FMUL) between the two, i.e. how much of the output's rescale runs under the Q @ K^T
    (kernel_gluon._rescaled). d512's Q @ K^T takes half of Q from registers: not counted there."""
    counts, muls = [], None
    for line in sass_text.splitlines():
        if re.search(r"HGMMA\.\S+ R\d+, gdesc", line):
            muls = 0 if muls is None else muls
        elif re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", line):
            if muls is not None:
                counts.append(muls)
            muls = None
        elif "DEPBAR" in line:
            muls = None
        elif " FMUL " in line and muls is not None:
            muls += 1
    return counts


def shipped() -> list[tuple[int, Config, int, str]]:
    """(head_dim, config, page size, span groups) of every kernel variant configs.pick and
    pick_gluon hand out for bf16 on a Hopper GPU: each head_dim's Gluon kernel, its global and
    short-window configs on packed K/V (TMA) and their pointer-load forms over 16-token pages,
    the Gluon kernels with span groups ("on": global, "clamp": short window); and kernel.py with
    span groups (GPUs without the Gluon kernels) at d128 and d256, packed."""
    out = []
    for d in (64, 128, 256, 512):
        gcfg = pick_gluon(d, torch.bfloat16)
        if gcfg:  # on packed K/V, reading 16-token pages, with span groups
            out += [(d, gcfg, 0, ""), (d, gcfg, 16, ""), (d, gcfg, 0, "on"), (d, gcfg, 16, "clamp")]
        kinds = {pick(d, torch.bfloat16, False), pick(d, torch.bfloat16, False, window=1024)}
        for cfg in sorted(kinds, key=repr):
            out.append((d, cfg, 0, ""))
            out.append((d, replace(cfg, tma=False), 16, ""))
    for d in (128, 256):
        out += [
            (d, pick(d, torch.bfloat16, False), 0, "on"),
            (d, pick(d, torch.bfloat16, False, 1024), 0, "clamp"),
        ]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128, help="head_dim")
    ap.add_argument("--paged", type=int, default=0, help="page size (0: packed K/V)")
    ap.add_argument("--groups", choices=["", "on", "clamp"], default="", help="compile with span groups")
    fields = "BLOCK_M,BLOCK_N,warps,stages,one_loop,dv_split,tma,gluon,persistent"
    ap.add_argument("--configs", nargs="+", help=fields)
    ap.add_argument("--shipped", action="store_true", help="every shipped config, one JSON line each")
    a = ap.parse_args()
    if a.shipped:
        for d, cfg, page, groups in shipped():
            r = gluon_stats(cfg, d, page, groups) if cfg.gluon else stats(cfg, d, page, groups)
            print(
                json.dumps({"d": d, "config": asdict(cfg), "page": page, "groups": groups, **r}), flush=True
            )
        return
    if not a.configs:
        ap.error("--configs or --shipped")
    for text in a.configs:
        v = [int(x) for x in text.split(",")]
        cfg = Config(*v[:4], *(bool(x) if i != 1 else x for i, x in enumerate(v[4:])))
        r = gluon_stats(cfg, a.d, a.paged, a.groups) if cfg.gluon else stats(cfg, a.d, a.paged, a.groups)
        flag = "  WGMMA SERIALIZED" if r["wgmma_serialized"] else ""
        flag += "  WGMMA WAIT INJECTED" if r["wgmma_wait_injected"] else ""
        kb = r["shared_bytes"] / 1024
        print(f"d{a.d} {text}: {kb:.0f} KB shared | {' | '.join(r['ptxas'])}{flag}", flush=True)


if __name__ == "__main__":
    main()
