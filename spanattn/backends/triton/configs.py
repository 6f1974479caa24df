"""Launch configurations per head_dim and dtype. Only these and the model's head counts are
compile-time constants, so the kernel compiles once per layer kind, not per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # the FULL loop only; needs triton >= 3.4 on Hopper/Blackwell


# Hopper (H200) choices, tuned with benchmarks/gpu_triton.py: the K and V tiles of each stage and
# the Q tile must fit the 227 KB of shared memory, the fp32 accumulator BLOCK_M x HEAD_DIM the
# registers of num_warps warps.
GPU_CONFIGS = {
    16: Config(128, 64, 4, 3),
    32: Config(128, 64, 4, 3),
    64: Config(128, 64, 4, 3),
    128: Config(128, 128, 8, 3),
    256: Config(128, 64, 8, 2),
    512: Config(64, 32, 8, 2),
}

# Small tiles for TRITON_INTERPRET=1 (CPU tests): cheap per step and many tile edges to cross.
INTERPRETER_CONFIG = Config(16, 16, 4, 1)


def padded_head_dim(d: int) -> int | None:
    """The power of two the kernel computes ``d`` in, or None if unsupported."""
    if d < 1 or d > MAX_HEAD_DIM or d % 16:
        return None
    p = 16
    while p < d:
        p *= 2
    return p


def pick(head_dim: int, dtype: torch.dtype, interpreted: bool) -> Config:
    if interpreted:
        return INTERPRETER_CONFIG
    cfg = GPU_CONFIGS[padded_head_dim(head_dim)]
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        cfg = Config(min(cfg.block_m, 64), min(cfg.block_n, 32), cfg.num_warps, min(cfg.num_stages, 2))
    return cfg
