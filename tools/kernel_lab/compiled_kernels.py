"""How many variants of each kernel a triton-backend step launches have been compiled so far in
this process (triton's per-device caches): the scripts count recompilations with it, and which
prefill kernel actually ran."""

from __future__ import annotations


def compile_counts():
    """Compiled variants so far of every kernel a prefill step launches: planning's interval
    kernel, the tile schedule's and the attention kernel."""
    from spanattn import intervals_triton
    from spanattn.backends.triton import kernel, kernel_gluon, kernel_gluon_split, schedule_triton

    kernels = {"attn_fwd": kernel.attn_fwd, "attn_fwd_gluon": kernel_gluon.attn_fwd_gluon,
               "attn_fwd_gluon_split": kernel_gluon_split.attn_fwd_gluon_split,
               "schedule": schedule_triton._tile_info_kernel,
               "intervals": intervals_triton._intervals_kernel}  # fmt: skip
    counts = {}
    for name, fn in kernels.items():
        caches = getattr(fn, "device_caches", {})
        counts[name] = sum(len(c[0]) for c in caches.values())
    return counts
