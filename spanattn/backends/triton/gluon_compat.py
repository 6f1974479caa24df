"""Gluon names that moved between triton releases, resolved once for the kernels."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# TMA's global-to-shared copy: ``async_copy_global_to_shared`` in triton 3.6, ``async_load`` later.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# A barrier over the calling partition's warps: ``thread_barrier`` in triton 3.6, ``barrier`` later.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
