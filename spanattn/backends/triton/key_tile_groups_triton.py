"""group_walk.key_tile_groups in one Triton launch, and the plan's cached table that the Gluon
kernels read (``plan_key_tile_groups``: this launch on CUDA, the torch definition elsewhere).
The definition is ~12 small kernels over a ``[key rows, block_n]`` view, launch-bound on a GPU
(0.64-0.68 ms of host time per step on a 17k-token video step on an H200); tests hold the two
equal, exactly, under ``TRITON_INTERPRET=1`` without a GPU.

Each program takes ``BLOCK`` key rows and loads each row's window of ``block_n`` key groups as
one ``[BLOCK, block_n]`` block (keys past the step's last one in no group, as the definition
pads them); the window's group, its keys in no group and where their run starts and ends are
row reductions of that block. ``total_k`` is a runtime scalar exempt from specialization, so a
new step never compiles a new kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .group_walk import key_tile_groups

KEYS_PER_PROGRAM = 4096  # BLOCK rows x block_n keys: a 32 x 128 block at 128-key tiles


@triton.jit(do_not_specialize=["total_k"])
def _key_tile_groups_kernel(k_group_ptr, out_ptr, total_k, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col = tl.arange(0, BLOCK_N)
    keys = rows[:, None] + col[None, :]
    window = tl.load(k_group_ptr + keys, mask=keys < total_k, other=-1)
    g = tl.max(window, 1)
    one_group = tl.min(tl.where(window >= 0, window, 2147483647), 1) == g
    none = window < 0
    count = tl.sum(none.to(tl.int32), 1)
    a = tl.min(tl.where(none, col[None, :], BLOCK_N), 1)  # the first key in no group
    b = tl.max(tl.where(none, col[None, :] + 1, 0), 1)  # past the last one
    one_run = (count == 0) | (b - a == count)
    ok = (g >= 0) & (g < 32768) & one_group & one_run
    code = (g << 16) | tl.where(count > 0, (b << 8) | a, 0)
    tl.store(out_ptr + rows, tl.where(ok, code, -1), mask=rows < total_k)


def launch_args(k_group: torch.Tensor, block_n: int, out: torch.Tensor, block: int | None = None):
    """Grid, arguments and constexprs of one launch (the tests read the compile key off them)."""
    total_k = k_group.shape[0]
    block = block or max(1, KEYS_PER_PROGRAM // block_n)
    return (triton.cdiv(total_k, block),), (k_group, out, total_k), dict(BLOCK=block, BLOCK_N=block_n)


def key_tile_groups_triton(groups, block_n: int, block: int | None = None) -> torch.Tensor:
    """``key_tile_groups(groups, block_n)`` in one launch; ``block_n`` and ``block`` (key rows per
    program, by default ``KEYS_PER_PROGRAM // block_n``) powers of two."""
    out = torch.empty_like(groups.k_group)
    grid, args, constexprs = launch_args(groups.k_group, block_n, out, block)
    _key_tile_groups_kernel[grid](*args, **constexprs)
    return out


def plan_key_tile_groups(plan, block_n: int) -> torch.Tensor:
    """The key tile groups of ``plan.groups`` for ``block_n``-key tiles, built once per plan
    (every layer of the step and every schedule of that key tile size reuse them)."""
    if block_n > 255:  # a run's end offset b must fit the code's 8 bits
        raise ValueError(f"key tile groups encode offsets in 8 bits: block_n must be <= 255, got {block_n}")
    g = plan.groups
    build = key_tile_groups_triton if plan.device.type == "cuda" else key_tile_groups
    return plan.cached(("triton.key_tile_groups", block_n), lambda: build(g, block_n))
