"""The triton backend: a forward kernel over packed varlen q/k/v driven by the plan's
intervals, skipping key tiles outside ``[min lo, max hi]`` and masking only the tiles that cut
an interval (kernel.py; on Hopper at head_dim 128-512 its warp-specialized Gluon forms,
kernel_gluon.py and kernel_gluon_split.py), and a split-KV kernel for decode-shaped steps
(decode.py). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (slow; for tests; the Gluon
kernels never)."""

from __future__ import annotations

import functools
import importlib
import os
import sys
import weakref

import torch

from .columns import INFO
from .configs import Config, padded_head_dim, pick, pick_gluon
from .group_tensors import gluon_group_args, group_args
from .scales import kernel_scales
from .schedule_triton import tile_schedule
from .tma_layout import rebased, tma_form, token_major

# SPANATTN_TRITON_GLUON=0 keeps every step on kernel.py (a check against the Gluon kernels, or a
# way around them on a toolchain where they misbehave); =1 runs them on any triton without their
# self-check (gluon_check.py), and the Gluon backward (gluon_backward_runs); =check self-checks
# them on any triton. Read per call.
GLUON_ENV = "SPANATTN_TRITON_GLUON"
AUTO_NEEDS_CUDA = True  # backend="auto" never picks the interpreter; naming "triton" still can
# Device plans (device_plan.py) run on the pointer-load kernel and the split-KV decode kernel:
# TMA and the Gluon kernels need every sequence a key tile long, which only the host knows, and
# paged steps read their pages in place.
DEVICE_PLANS = True

# Paged prefill over pages smaller than a key tile pays a page lookup and address math per key
# row on every key tile of every query head it walks, on pointer loads, while packed K/V come
# through TMA. Copying the step's keys out of the pages instead (page_copy.py, ~3.7 TB/s) costs
# one read and write of K/V, per KV head and head_dim element. So the copy wins when each key is
# seen by many (query, key) pairs x query heads per KV head, relative to head_dim. Measured at
# page 16, GQA 2, value of the rule below in brackets (results/2026-11-29-paged-prefill-h200-v11
# .json, after host TMA descriptors sped up the packed path): S2 [32-64k] copy +0.7-1.3% vs walk
# +17-21%; S1 d128 [2048] copy +10% vs walk +21%; S1 d256 [1024] copy +6.9% vs walk +18%; S3
# d256 [413] copy +20% vs walk +18.5%.
GATHER_PAIRS_PER_KEY = 768  # at head_dim 128; scaled by head_dim / 128
# Pages of at least a key tile walk cheaper (one page entry per tile): at 128-token pages S1 d128
# [2048] walks at 1.137x where a copy costs ~8%, S1 d256 [1024] walks at 1.05x, S3 [413] 1.056x
# (v11): copy those from twice the threshold.
GATHER_WHOLE_PAGES_FACTOR = 2


def gathers_pages(plan, page_size: int, block_n: int, group: int = 1, head_dim: int = 128) -> bool:
    """Copy the pages of a prefill step into packed K/V before attending? ``group`` = query heads
    per KV head. Decided from the host-side batch (pairs bounded by ``q_len x min(kv_len, W)``:
    spans and the causal triangle ignored), so it never synchronizes with the GPU."""
    threshold = GATHER_PAIRS_PER_KEY
    if page_size >= block_n:  # a tile lies in one page: the walk costs little, its tiles do
        threshold *= GATHER_WHOLE_PAGES_FACTOR
    w = plan.layer.window
    pairs = sum(s.q_len * (s.kv_len if w is None else min(s.kv_len, w)) for s in plan.batch.seqs)
    return pairs * group * 128 >= threshold * plan.total_k * head_dim


def copies_pages(q, plan, page_size: int, block_n: int, hkv: int, may_use_gluon: bool = True) -> bool:
    """Does a paged prefill step that no Gluon kernel reads in place (``gluon_reads_pages``: odd
    page sizes) copy its pages out (``_copy_pages``) before attending? Where a Gluon kernel would
    run on the copy (``gluon_runs_for``): against it the triton kernel's walk took 1.20-1.49x the
    contiguous time at pages of 16 and 128 where the copy took 1.01-1.23x (S1-S3,
    results/2026-11-29-paged-prefill-h200-s6.json); elsewhere as ``gathers_pages`` says for
    ``block_n``-key tiles walking the pages. Never for a device plan (its keys are counted on
    the device only)."""
    if plan.capacity is not None:
        return False
    gcfg = pick_gluon(q.shape[-1], q.dtype) if may_use_gluon else None
    if gcfg is not None and gluon_runs_for(q, plan, gcfg):
        return True
    return gathers_pages(plan, page_size, block_n, q.shape[1] // hkv, q.shape[-1])


def _copy_pages(plan, k, v, block_table, page_size: int):
    """The step's keys and values out of flat pages into packed buffers kept on the plan: every
    layer of the step reuses them (no allocation per call; the content is overwritten)."""
    from .page_copy import copy_pages

    shape = (plan.total_k, *k.shape[1:])
    bk, bv = plan.cached(
        ("paged_copy", k.dtype, k.device, shape), lambda: (k.new_empty(shape), v.new_empty(shape))
    )
    copy_pages(plan, k, v, block_table, page_size, bk, bv)
    return bk, bv


def uses_tma(plan, k, v, cfg: Config) -> bool:
    """Read packed K/V tiles through TMA? Needs a config that asks for it, sm_90+ (or the
    interpreter, for tests), 16-byte aligned bases and row strides, each token's heads side by
    side (``stride(1) == D``: K/V are read as ``[total_k, Hkv * D]`` matrices), head_dim a power of
    two (a padded tile would read the next head's columns), and every sequence at least one key
    tile long (a tile never runs past its sequence's end: kernel.attn_fwd)."""
    if not cfg.tma or (k.is_cuda and _capability(k.device)[0] < 9):
        return False
    d = k.shape[-1]
    return padded_head_dim(d) == d and plan.min_seqlen_k >= cfg.block_n and token_major(k) and token_major(v)


# The Gluon kernels by query rows per tile: kernel_gluon.py splits 128 rows over its consumers
# at d128/d256, kernel_gluon_split.py splits head_dim 512 over them on 64-row tiles.
GLUON_KERNELS = {(128, 128): "kernel_gluon", (256, 128): "kernel_gluon", (512, 64): "kernel_gluon_split"}


def uses_gluon(q, k, v, plan, cfg: Config) -> bool:
    """Run a warp-specialized Gluon kernel (GLUON_KERNELS) on ``cfg``'s tiles? Where
    ``gluon_runs_for`` q and the plan, and TMA can read k and v (``tma_matrix``: token-major as
    packed varlen tensors are, or head-major as transformers' KV cache is; K and V alike)."""
    if not gluon_runs_for(q, plan, cfg):
        return False
    fk, fv = tma_form(k), tma_form(v)
    return None not in (fk, fv) and fk[3:] == fv[3:]


def gluon_reads_pages(q, k, v, plan, cfg: Config, page_size: int) -> bool:
    """Run a Gluon kernel straight on a paged cache (flat ``k, v [pages * page_size, Hkv, D]``)?
    Where ``uses_gluon`` would on packed K/V, the cache holds each token's heads side by side,
    and a page holds whole key tiles or a tile whole pages, in multiples of 8 rows (TMA boxes of
    ``min(page_size, block_n)`` rows, each inside one page, in the shared-memory layout's 8-row
    swizzle atoms)."""
    sub = min(page_size, cfg.block_n)
    if page_size % 8 or max(page_size, cfg.block_n) % sub or not uses_gluon(q, k, v, plan, cfg):
        return False
    return tma_form(k).head_rows == 0


def gluon_runs_for(q, plan, cfg: Config) -> bool:
    """Everything ``uses_gluon`` asks but K/V's layout: a Gluon kernel built for head_dim and
    ``cfg.block_m``, q bf16/fp16 and TMA-readable, every sequence at least ``cfg.block_n`` keys
    long (a tile never runs past its sequence's end), and ``gluon_runs_on`` the device."""
    name = GLUON_KERNELS.get((q.shape[-1], cfg.block_m))
    if not (cfg.gluon and cfg.tma and name and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not gluon_runs_on(q.device, name) or plan.min_seqlen_k < cfg.block_n:
        return False
    return tma_form(q) is not None


def gluon_runs_on(device, name: str = "kernel_gluon") -> bool:
    """Can Gluon kernel module ``name`` run on ``device``? An sm_90 GPU (its MMAs are Hopper's)
    and a triton with Gluon: one the kernels were checked on, or one where they pass their
    first-use self-check (gluon_check.py). ``SPANATTN_TRITON_GLUON=1`` skips the check, ``=0``
    never runs them, ``=check`` runs the self-check on any triton."""
    setting = os.environ.get(GLUON_ENV, "")
    if setting == "0" or torch.device(device).type != "cuda":
        return False
    if _capability(torch.device(device)) != (9, 0) or _gluon_module(name) is None:
        return False
    from . import gluon_check

    if setting == "1" or gluon_check.running(name):
        return True
    if setting != "check" and _gluon_module("gluon_parts").checked_triton():
        return True
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return gluon_check.passes(name, index, sys.modules[__name__])  # the check runs this package


@functools.cache
def _gluon_module(name: str):
    try:  # triton.experimental.gluon exists from triton 3.4 on
        return importlib.import_module(f"{__name__}.{name}")
    except (ImportError, AttributeError):  # or a Gluon name moved (gluon.constexpr_function, say)
        return None


def _descriptors(k, v, cfg: Config, d: int):
    """Host TMA descriptors of K and V seen as ``[total_k, Hkv * D]`` matrices, read in
    ``BLOCK_N x D`` tiles (values in ``BLOCK_N x D / dv_split``): made once per launch, where
    descriptors made in the kernel cost every program a global write and a fence (S1 d128 on one
    program per SM: 5.6% of its time, results/2026-11-29-triton-h200-s4-sweep.json)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, cols):
        return TensorDescriptor(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [cfg.block_n, cols])

    return desc(k, d), desc(v, d // cfg.dv_split)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _kernel_module():
    # Imported on first use so that importing spanattn never needs triton.
    return importlib.import_module(__name__ + ".kernel")


def prepare(plan, head_dim: int, dtype: torch.dtype = torch.bfloat16, group: int = 1, backward: bool = False):
    """Build the step's tile schedule (and span groups' tile runs) ahead of the first layer
    (cached on the plan): what a step pays once for this backend besides ``spanattn.plan``, so
    that benchmarks count it. The schedule of the kernel that will run, as far as the plan
    tells (a Gluon kernel needs TMA-readable inputs too). A device plan keeps it and rebuilds
    it at every planner update, unless its steps go to the decode kernel (``group``: query
    heads per KV head). ``backward``: the backward's too (its key tiles and dQ's query tiles),
    built once per step instead of by every layer's backward."""
    kmod = _kernel_module()
    if backward:
        _prepare_backward(plan, head_dim, dtype, kmod.INTERPRETED)
    if plan.capacity is not None:
        from .decode import suited
        from .schedule import build_device_schedule

        if suited(plan, group):
            return
        cfg = pick(head_dim, dtype, kmod.INTERPRETED, plan.layer.window, tma=False)
        bm, bn = cfg.block_m, cfg.block_n
        plan._prepare_table(
            ("triton.tiles", bm, bn, True), lambda out: build_device_schedule(plan, bm, bn, True, out)
        )
        return
    gcfg = pick_gluon(head_dim, dtype)
    name = gcfg and GLUON_KERNELS.get((head_dim, gcfg.block_m))
    if name and gluon_runs_on(plan.device, name) and plan.min_seqlen_k >= gcfg.block_n:
        gluon_group_args(plan, tile_schedule(plan, gcfg.block_m, gcfg.block_n))
        return
    cfg = pick(head_dim, dtype, kmod.INTERPRETED, plan.layer.window)
    tile_schedule(plan, cfg.block_m, cfg.block_n)
    group_args(plan, cfg.block_n)


# Whether the Gluon backward kernels passed their GPU tests (tests/test_triton_backward.py, Hopper
# only) on a triton they were checked on (gluon_parts.CHECKED_TRITON): until then they run only
# when asked for. Once checked, other tritons run them after their first-use self-check
# (gluon_check.py), as the forward's.
GLUON_BACKWARD_CHECKED = False


def gluon_backward_runs(plan, head_dim: int, dtype: torch.dtype) -> bool:
    """Does the backward run on kernel_gluon_dkdv and kernel_gluon_dq (where TMA can read q, k, v
    and dO; dQ where every sequence is a key tile long)? Hopper, bf16/fp16, the head_dims they
    are built for, no span groups, and checked (``GLUON_BACKWARD_CHECKED``: on a checked triton,
    or after the self-check) or asked for (``SPANATTN_TRITON_GLUON=1``; ``=check`` self-checks
    them; ``=0`` never): they compile for sm_90 and keep their wgmma asynchronous
    (tests/test_kernels_compile.py), but have not yet been run on a GPU."""
    if plan.groups is not None or dtype not in (torch.bfloat16, torch.float16):
        return False
    setting = os.environ.get(GLUON_ENV, "")
    device = torch.device(plan.device)
    if setting == "0" or device.type != "cuda" or _capability(device) != (9, 0):
        return False
    module = _gluon_module("kernel_gluon_dkdv")
    if module is None or head_dim not in module.HEAD_DIMS:
        return False
    from . import gluon_check

    if setting == "1" or gluon_check.running(gluon_check.BACKWARD):
        return True
    if setting != "check" and not GLUON_BACKWARD_CHECKED:
        return False
    if setting != "check" and _gluon_module("gluon_parts").checked_triton():
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return gluon_check.passes(gluon_check.BACKWARD, index, sys.modules[__name__])


def _prepare_backward(plan, head_dim: int, dtype: torch.dtype, interpreted: bool) -> None:
    from .configs import pick_backward
    from .key_schedule import build_key_schedule, key_schedule

    dkdv, dq = pick_backward(head_dim, dtype, interpreted)
    km, kn, qm, qn = dkdv.block_m, dkdv.block_n, dq.block_m, dq.block_n
    if gluon_backward_runs(plan, head_dim, dtype):  # the tiles of the kernels gradients.py runs
        g = _gluon_module("gluon_backward")
        km, kn = g.key_tiles(head_dim)
        if g.dq_fits(plan, head_dim):
            qm, qn = g.query_tiles(head_dim)
    if plan.capacity is None:
        key_schedule(plan, km, kn)
        tile_schedule(plan, qm, qn)
        return
    from .schedule import build_device_schedule

    plan._prepare_table(
        ("triton.key_tiles", km, kn, True), lambda out: build_key_schedule(plan, km, kn, True, out)
    )
    plan._prepare_table(
        ("triton.tiles", qm, qn, True), lambda out: build_device_schedule(plan, qm, qn, True, out)
    )


def unavailable(q, plan, **opts) -> str | None:
    try:
        kernel = _kernel_module()
    except ImportError as e:
        return f"triton is not installed ({e})"
    if q.device.type != "cuda" and not kernel.INTERPRETED:
        return f"needs a CUDA device (q is on {q.device}) or TRITON_INTERPRET=1 set before import"
    if q.dtype == torch.float64:
        return "its kernels compute in float16/bfloat16/float32, not float64"
    if kernel.INTERPRETED and q.dtype == torch.bfloat16:
        return "the Triton interpreter (TRITON_INTERPRET=1) cannot run bfloat16"
    d = q.shape[-1]
    if padded_head_dim(d) is None:
        return f"head_dim must be a multiple of 16 up to 512, got {d}"
    return None


def no_backward(q, plan, **opts) -> str | None:
    return None  # gradients.py: every step its forward kernels run on packed K/V, host or device plan


def backward(q, k, v, out, lse, dout, plan, *, scale, softcap=None, dlse=None):
    """dq, dk, dv from the forward's ``out`` and ``lse`` (gradients.py: the dK/dV kernel over each
    key tile's column hull, the dQ kernel over each query tile's row hull)."""
    from .gradients import backward as kernels  # imported on first use, like the forward's kernels

    gluon = gluon_backward_runs(plan, q.shape[-1], q.dtype)
    return kernels(q, k, v, out, lse, dout, plan, scale=scale, softcap=softcap, dlse=dlse, gluon=gluon)


def forward(
    q,
    k,
    v,
    plan,
    *,
    scale,
    softcap=None,
    return_lse=False,
    out=None,
    config: Config | None = None,
    lpt: bool = True,
    block_table=None,
    page_size: int | None = None,
    kernel: str = "auto",
):
    """``out [total_q, Hq, D]`` and ``lse [total_q, Hq]`` (fp32, natural log) or None.

    block_table: paged K/V, ``k, v [num_blocks, page_size, Hkv, D]`` (or viewed flat
        ``[num_blocks * page_size, Hkv, D]`` with ``page_size``); position ``pos`` of sequence
        ``s`` is in block ``block_table[s, pos // page_size]`` at offset ``pos % page_size``.
        Prefill steps over pages smaller than a key tile whose keys are each seen by many
        queries copy the pages out first (``gathers_pages``); otherwise pages are read in place.
    kernel: ``"auto"`` sends decode-shaped steps (every ``q_len`` small) to the split-KV decode
        kernel and the rest to the prefill kernel; ``"prefill"`` forces the latter.
    out: preallocated output (tests poison it). config: override the prefill tile/warp choice.

    What a call runs (kernel, tiles, schedule, descriptors) is decided once per call shape
    (``call_shape``) and kept on a host plan: later calls of that shape only allocate the output
    and launch.
    """
    key = call_shape(q, k, v, out, block_table, page_size, softcap, return_lse, config, lpt, kernel)
    if key is None:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    run = plan._facts.get(key) if key is not None and plan.capacity is None else None
    if run is None:
        run = _route(q, k, v, plan, softcap, return_lse, out, config, lpt, block_table, page_size, kernel)
        if key is not None and plan.capacity is None:
            plan._facts[key] = run
    return run(q, k, v, out, block_table, scale, softcap)


def call_shape(q, k, v, out, block_table, page_size, softcap, return_lse, config, lpt, kernel):
    """Everything of a call that ``_route``'s choices and the launched kernels' compiled forms
    depend on (shapes, strides, dtypes, devices, 16-byte alignment of every tensor; the flags;
    the Gluon setting), or None where q, k or v has a strided last dimension (copied per call)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    tensors = (q, k, v) + tuple(t for t in (out, block_table) if t is not None)
    facts = tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)
    flags = (out is None, page_size, bool(softcap), return_lse, config, lpt, kernel)
    return ("triton.call", facts, flags, os.environ.get(GLUON_ENV, ""))


def _route(q, k, v, plan, softcap, return_lse, out, config, lpt, block_table, page_size, kernel):
    """The kernel this call shape runs, as ``run(q, k, v, out, block_table, scale, softcap) ->
    (out, lse)``; raises what the call cannot do."""
    why = unavailable(q, plan)
    if why is not None:
        raise RuntimeError(f"triton backend: {why}")
    if kernel not in ("auto", "prefill"):
        raise ValueError(f"kernel must be 'auto' or 'prefill', got {kernel!r}")
    paged = block_table is not None
    if paged and k.dim() == 4:
        page_size = k.shape[1]
    elif paged and not page_size:
        raise ValueError("paged K/V needs page_size")
    _, hq, d = q.shape
    hkv = k.shape[-2]
    if kernel == "auto" and config is None:
        from . import decode  # the split-KV kernel reads every K/V byte once per KV head

        if decode.suited(plan, hq // hkv):
            pages = lambda t: t if not paged or t.dim() == 4 else t.unflatten(0, (-1, page_size))
            launch = decode.DecodeLaunch(
                q, pages(k), pages(v), plan, softcap=bool(softcap), return_lse=return_lse, paged=paged
            )
            return lambda q, k, v, out, bt, scale, cap: launch(q, pages(k), pages(v), scale, cap, bt, out)
    from .direct_launch import DirectLaunch

    kmod = _kernel_module()
    choose = lambda tma: config or pick(d, q.dtype, kmod.INTERPRETED, plan.layer.window, tma)
    flat = lambda t: t.flatten(0, 1) if t.dim() == 4 else t
    k, v, block_table = flat(k), flat(v), _int32_rows(block_table)
    gcfg = config if config is not None else pick_gluon(d, q.dtype)
    gcfg = gcfg if gcfg is not None and gcfg.gluon else None
    gluon_pages = paged and gcfg is not None and gluon_reads_pages(q, k, v, plan, gcfg, page_size)
    block_n = choose(False).block_n
    copy = paged and not gluon_pages and copies_pages(q, plan, page_size, block_n, hkv, config is None)
    if copy:
        k, v = _copy_pages(plan, k, v, block_table, page_size)
    paged = paged and not copy
    plan_ref = weakref.ref(plan)  # kept on the plan: the plan itself would make a reference cycle
    new_out = _outputs(q, return_lse)

    def inputs(k, v, bt, out):
        """This call's K/V (pages copied out where this route copies them), its int32 block
        table, output and LSE."""
        k, v, bt = flat(k), flat(v), _int32_rows(bt)
        if copy:
            k, v = _copy_pages(plan_ref(), k, v, bt, page_size)
        return (k, v, bt, *new_out(out))

    if gcfg is not None:
        if gluon_pages or (not paged and uses_gluon(q, k, v, plan, gcfg)):
            sched = tile_schedule(plan, gcfg.block_m, gcfg.block_n, lpt)
            launch = _gluon_module(GLUON_KERNELS[(d, gcfg.block_m)]).launch(
                q, k, v, plan, sched, out.stride() if out is not None else (hq * d, d), return_lse,
                bool(softcap), gcfg.num_stages, paged=gluon_pages, page_size=page_size or 0,
                bt_stride=block_table.stride(0) if gluon_pages else 0,
                groups=gluon_group_args(plan, sched), persistent=gcfg.persistent,
            )  # fmt: skip

            def run_gluon(q, k, v, out, bt, scale, softcap):
                k, v, bt, out, lse = inputs(k, v, bt, out)
                launch(q, k, v, out, lse, *kernel_scales(scale, softcap), bt)
                return out, lse

            return run_gluon
        if config is not None:
            raise ValueError(f"config {config} asks for a Gluon kernel, which cannot run here (uses_gluon)")
    tma = not paged and uses_tma(plan, k, v, choose(True))
    cfg = choose(tma)
    sched = tile_schedule(plan, cfg.block_m, cfg.block_n, lpt)
    descs = _descriptors(k, v, cfg, d) if tma else None
    groups = plan.groups
    plan_tensors = (plan.lo, plan.hi, sched.info, plan.seq_lens)
    launch = DirectLaunch(kmod.attn_fwd, (sched.num_tiles * hq * cfg.dv_split,), dict(
        HQ=hq, GROUP=hq // hkv, HEAD_DIM=padded_head_dim(d), D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SOFTCAP=bool(softcap), RETURN_LSE=return_lse, PAGED=paged, PAGE_SIZE=page_size or 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHILE_LOOPS=kmod.INTERPRETED,
        ONE_LOOP=cfg.one_loop, DV_SPLIT=cfg.dv_split, TMA=tma, N_INFO=len(INFO),
        GROUPS=groups is not None, CLAMP=groups is not None and groups.clamp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ))  # fmt: skip
    group_tensors = group_args(plan, cfg.block_n)
    last_page = k.shape[0] // page_size - 1 if paged else 0

    def run_kernel(q, k, v, out, bt, scale, softcap):
        k, v, bt, out, lse = inputs(k, v, bt, out)
        kd, vd = (rebased(descs[0], k), rebased(descs[1], v)) if tma else (k, v)
        launch(
            q, k, v, kd, vd, out, lse if lse is not None else out, *plan_tensors[:3],
            bt if paged else plan_tensors[3], *group_tensors,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), bt.stride(0) if paged else 0, last_page,
            *kernel_scales(scale, softcap),
        )  # fmt: skip
        return out, lse

    return run_kernel


def _outputs(q, return_lse: bool):
    """``new(out) -> (out, lse)``: the call's output (``out`` or a new one like ``q``, packed)
    and LSE (fp32, or None)."""
    total_q, hq, d = q.shape
    dtype, device = q.dtype, q.device

    def new(out):
        if out is None:
            out = torch.empty(total_q, hq, d, dtype=dtype, device=device)
        lse = torch.empty(total_q, hq, dtype=torch.float32, device=device) if return_lse else None
        return out, lse

    return new


def _int32_rows(block_table):
    """A block table as the kernels read it: int32, unit column stride (None stays None)."""
    if block_table is None or (block_table.dtype == torch.int32 and block_table.stride(1) == 1):
        return block_table
    return block_table.to(torch.int32).contiguous()


__all__ = ["Config", "backward", "forward", "no_backward", "prepare", "unavailable"]
