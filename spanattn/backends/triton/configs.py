"""Launch configurations per head_dim and dtype. Only these and the model's head counts are
compile-time constants, so the kernel compiles once per layer kind, not per step."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    one_loop: bool = False  # one KV loop masking tiles at run time, not PARTIAL/FULL/PARTIAL loops
    dv_split: int = 1  # programs sharing a query tile, each computing 1/dv_split of the output columns
    tma: bool = False  # packed K/V tiles through TMA descriptors (sm_90+, head_dim a power of two)
    # a Gluon kernel's tiles (GLUON_CONFIGS): block_m, block_n and num_stages hold, the rest not
    gluon: bool = False
    # a Gluon kernel's launch: one program per SM taking work items as it goes (gluon_deal.py),
    # each item's Q and first K/V loaded under the previous item's last P @ V and stores (False:
    # one program per item, as the hardware deals them)
    persistent: bool = True


# Hopper (H200) choices from tools/kernel_lab/gpu_triton.py's sweep (benchmarks/results/
# 2026-11-29-triton-h200.json): the Q tile and num_stages K+V tiles must fit 227 KB of shared
# memory, the fp32 accumulator BLOCK_M x HEAD_DIM the registers of num_warps warps. d256 and d512
# run faster with one KV loop (+10%): three separately pipelined loops cost more than the
# run-time mask branch there (and at d128 on 4 warps: S2 -10% with three loops). d512 splits the
# output columns over two programs (128 x 256 accumulators): 1.5x the FLOPs, +27% speed
# (results/2026-11-29-triton-h200-d512.json). K/V tiles through TMA (sm_90+; pointer loads
# elsewhere): S0 d128 +3.5%, S5 d512 +5.5%, S1 d128 +1.5%, d256 +-1% (2026-11-29-triton-tma-h200.json)
# with descriptors made in the kernel per program; made once on the host instead, S1 d128 gains
# another 5.6% and S5 2.2% (results/2026-11-29-triton-h200-s4-sweep.json).
# d128: 4 warps on 128 x 64 tiles, two stages (96 KB: two programs per SM, one's softmax under
# the other's MMAs) beat 8 warps on 128 x 128 x 3 stages (224 KB, one program) by 4% on S0/S2
# while each program built its own descriptors; with host descriptors and per-tile bounds read
# in one round (columns.INFO), 8 warps won the geometric mean of S0/S2/S4 (s5.json), and three
# loops on those tiles beat one loop there: S0 +2.1%, S2 +3.8%, S4 -0.9% (s7-sweep.json; 16-warp
# 256-row tiles ran 5-20% slower). Without TMA (paged walks, pre-Hopper GPUs, misaligned
# strides, a sequence shorter than a key tile) the same tiles are read through pointers; three
# loops on 8 warps also suit paged prefill (S2 over 128-token pages at 1.115x the contiguous
# time, where 4 warps holding their tiles' addresses spilled and ran 1.51x: paged-prefill v9, v8).
# On sm_90 the warp-specialized Gluon kernels (GLUON_CONFIGS) replace these where they can run.
GPU_CONFIGS = {
    16: Config(128, 64, 4, 3, tma=True),
    32: Config(128, 64, 4, 3, tma=True),
    64: Config(128, 64, 4, 3, tma=True),
    128: Config(128, 128, 8, 3, tma=True),
    256: Config(128, 64, 8, 2, one_loop=True, tma=True),
    512: Config(128, 32, 8, 2, one_loop=True, dv_split=2, tma=True),
}

# Sliding-window layers (window <= WINDOW_MAX): every query tile walks only a few key tiles, so
# pipeline fills weigh more and one loop wins at every head_dim (S1: +4% d128, +10% d256).
WINDOW_MAX = 4096
WINDOW_CONFIGS = {
    128: Config(128, 128, 8, 3, one_loop=True, tma=True),
    256: Config(128, 64, 8, 2, one_loop=True, tma=True),
}

# The Gluon kernels (sm_90, K/V and Q by TMA, bf16/fp16), for every layer kind of a head_dim:
# kernel_gluon.py's 128-query tiles split in rows over its two consumer warpgroups at d128 (S0
# 496 -> 618 TFLOP/s, S1 373 -> 405 over the triton kernel: bench-h200-s5 vs s6) and d256 (2
# stages fit; S0 532 -> 623, S1 389 -> 434: triton-h200-s11-d256-gluon.json), and
# kernel_gluon_split.py's 64-query tiles split in head_dim at d512 (32-key tiles in 2 stages, 213
# KB, 230 since the score exchange's two slots: S5 272 -> 392; 64-key tiles in one stage 315,
# 16-key in four 288:
# triton-h200-s12-d512-gluon.json; 415 since the rescale skipping of gluon_rescale.py).
# Persistent launches (one program per SM taking work items) against one program per item,
# alternating on the H200 (results/2026-12-01-short-walks-*.json): short walks gain (S1
# d128/d256 +6.9/+5.4%, S3 +4.7%, S4 +2.7%), long ones were even (S0/S2 0.99-1.02x) while the
# items were dealt in a fixed order; at d512 that order ran S5 6% slower than the hardware's own
# dispatch (48.8 vs 46.0 ms). Dealt at run time in L2-sized sections of KV heads (gluon_deal.py)
# every head_dim runs persistent: against the fixed deal (d512: one program per item) S0-S2 and
# S4 1.1-2.8% less time, S5 2.6%, S3 even (results/2026-12-02-ab-trees-run-time-deal-late-h200.json).
GLUON_CONFIGS = {
    128: Config(128, 128, 8, 3, tma=True, gluon=True),
    256: Config(128, 64, 8, 2, tma=True, gluon=True),
    512: Config(64, 32, 8, 2, tma=True, gluon=True),
}

# Small tiles for TRITON_INTERPRET=1 (CPU tests): cheap per step and many tile edges to cross.
INTERPRETER_CONFIG = Config(16, 16, 4, 1)

# The backward's kernels (backward.py), per head_dim: (dK/dV, dQ). The dK/dV kernel holds a key
# tile's K and V (block_n x head_dim) and fp32 dK, dV accumulators (block_n x head_dim / dv_split
# each) while it walks block_m-query tiles; the dQ kernel holds a query tile's Q, dO and fp32 dQ
# while it walks block_n-key tiles. dv_split: programs sharing a tile, each owning 1/dv_split of
# the output columns (recomputing the scores and dO V^T at full width, as the forward's d512).
# Chosen by ptxas's report for sm_90 alone (tools/kernel_lab/compile_stats_backward.py, triton 3.9,
# bf16; registers per thread in the comments, without span groups / with groups in clamp mode
# and a softcap): no spills but d256's dQ with groups and a softcap (20 B), Hopper's wgmma where
# 64 rows a warpgroup fit. NOT YET RUN OR TIMED ON A GPU: guesses until then. Rejected for
# spills: dK/dV d16-d64 32 x 128 on 4 warps (the Triton tutorial's; 32-528 B), d128 64 x 64 or
# 64 x 128 (76-200 B), d256 on 64-key tiles (96-1220 B, split in two too), d512 on 32-key tiles
# (8 B; 3 KB at 64); dQ d256 128 x 32 (12 B) and 64 x 64 (196 B), d512 64-query tiles (116-456
# B). d256 and d512's dK/dV tiles (32 and 16 keys) and d512's dQ tiles are below wgmma's 64
# rows: the older mma instructions, the likeliest place to gain (a split of the walk, or Gluon).
BACKWARD_CONFIGS = {
    16: (Config(64, 128, 8, 2), Config(128, 32, 4, 3)),  # 210-246 / 121-194 registers
    32: (Config(64, 128, 8, 2), Config(128, 32, 4, 3)),  # 174-244 / 140-199
    64: (Config(64, 128, 8, 2), Config(128, 64, 8, 3)),  # 230-255 / 147-218
    128: (Config(32, 128, 8, 2), Config(128, 32, 8, 2)),  # 243-255 / 163-200
    256: (Config(32, 32, 8, 2), Config(64, 32, 8, 2)),  # 177-255 / 237-255
    512: (Config(32, 16, 8, 1, dv_split=2), Config(32, 32, 8, 1, dv_split=2)),  # 170-176 / 184-200
}

# fp32 (dots in IEEE fp32: no tensor cores, operands in registers): halving the tiles above
# spilled up to 852 B (dQ d128), 32 x 32 tiles up to 5 KB (d256), so small tiles, columns split
# from dQ d128 and dK/dV d512. ptxas, the same four variants: 0-68 B spilled (most at d16-d64).
# As untried on a GPU as the above.
BACKWARD_FP32_CONFIGS = {
    16: (Config(16, 32, 4, 2), Config(32, 16, 4, 2)),
    32: (Config(16, 32, 4, 2), Config(32, 16, 4, 2)),
    64: (Config(16, 32, 4, 2), Config(32, 16, 4, 2)),
    128: (Config(16, 32, 8, 1), Config(16, 16, 8, 1, dv_split=2)),
    256: (Config(16, 32, 8, 1), Config(16, 16, 8, 1, dv_split=2)),
    512: (Config(16, 16, 8, 1, dv_split=2), Config(16, 16, 8, 1, dv_split=2)),
}


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1). Plain Python: ``triton.next_power_of_2`` is a
    JIT function since triton 3.4 and costs microseconds of host time per call."""
    return 1 << max(n - 1, 0).bit_length()


def padded_head_dim(d: int) -> int | None:
    """The power of two the kernel computes ``d`` in, or None if unsupported."""
    if d < 1 or d > MAX_HEAD_DIM or d % 16:
        return None
    p = 16
    while p < d:
        p *= 2
    return p


@functools.cache  # called on every forward: the answer never changes for its arguments
def pick(
    head_dim: int, dtype: torch.dtype, interpreted: bool, window: int | None = None, tma: bool = True
) -> Config:
    """The config of a layer kind: head_dim, dtype, whether its window is short and whether K/V
    can be read through TMA (False: paged walks); never anything that changes from step to step
    (that would recompile)."""
    if interpreted:
        return INTERPRETER_CONFIG
    d = padded_head_dim(head_dim)
    short = window is not None and window <= WINDOW_MAX
    cfg = WINDOW_CONFIGS.get(d) if short else None
    cfg = cfg or GPU_CONFIGS[d]
    if not tma and cfg.tma:
        cfg = replace(cfg, tma=False)
    if dtype == torch.float32:
        cfg = _fit_fp32(cfg, d)
    return cfg


def pick_gluon(head_dim: int, dtype: torch.dtype) -> Config | None:
    """The Gluon kernel's tiles for this head_dim and dtype, if one is built for them (whether it
    can run on the device and inputs at hand is ``uses_gluon``'s to say)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return GLUON_CONFIGS.get(head_dim)


def _fit_fp32(cfg: Config, d: int, budget: int = 160 * 1024) -> Config:
    """fp32 tiles take twice the shared memory: shrink the K/V tile, then the pipeline depth,
    then the Q tile until Q plus num_stages K and V tiles fit well inside 227 KB (the margin is
    for the compiler's own layout-conversion buffers)."""
    bm, bn, stages = min(cfg.block_m, 64), min(cfg.block_n, 32), min(cfg.num_stages, 2)
    smem = lambda: 4 * (bm * d + stages * bn * (d + d // cfg.dv_split))
    while smem() > budget and bn > 16:
        bn //= 2
    while smem() > budget and stages > 1:
        stages -= 1
    while smem() > budget and bm > 16:
        bm //= 2
    return replace(cfg, block_m=bm, block_n=bn, num_stages=stages)


@functools.cache
def pick_backward(head_dim: int, dtype: torch.dtype, interpreted: bool) -> tuple[Config, Config]:
    """The backward's (dK/dV, dQ) configs of a layer kind (BACKWARD_CONFIGS, or
    BACKWARD_FP32_CONFIGS for fp32 inputs)."""
    if interpreted:
        return INTERPRETER_CONFIG, INTERPRETER_CONFIG
    table = BACKWARD_FP32_CONFIGS if dtype == torch.float32 else BACKWARD_CONFIGS
    return table[padded_head_dim(head_dim)]
