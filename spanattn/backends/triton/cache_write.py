"""Writing a step's new K/V rows into a paged cache on the GPU (vLLM's reshape_and_cache for the
NHD layout). A kernel rather than ``index_put_`` because padding rows (negative slots) must be
skipped without a host sync to filter them and without redirecting them to a shared dummy slot,
which would race with a real write."""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import next_pow2


@triton.jit
def _write_kv(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """One program per (token, KV head): copy one row of K and V if its slot is >= 0."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(SLOTS + tok).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        k = tl.load(K + tok * stride_kt + head * stride_kh + d, mask=ok)
        v = tl.load(V + tok * stride_vt + head * stride_vh + d, mask=ok)
        tl.store(K_CACHE + block * stride_kcb + off * stride_kct + head * stride_kch + d, k, mask=ok)
        tl.store(V_CACHE + block * stride_vcb + off * stride_vct + head * stride_vch + d, v, mask=ok)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """See spanattn.write_kv_cache (which checks the arguments)."""
    tokens, hkv, d = k.shape
    if tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    _write_kv[(tokens, hkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        HKV=hkv, D=d, BLOCK_D=next_pow2(d), PAGE_SIZE=k_cache.shape[1],
        num_warps=1 if d <= 128 else 2,
    )  # fmt: skip
