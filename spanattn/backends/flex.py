"""FlexAttention lowering: the packed varlen step as ONE sequence of ``total_q`` queries by
``total_k`` keys, ``mask_mod = alo[q_idx] <= kv_idx <= ahi[q_idx]`` (packed intervals, two
compares; with span groups also ``q_group[q_idx] == k_group[kv_idx] >= 0``) and a BlockMask
made directly from the plan's tile tables with ``BlockMask.from_kv_blocks`` (never
``create_block_mask``, which evaluates the mask on every pair).

Execution: CUDA runs ``torch.compile(..., dynamic=True)`` of one function that builds the
BlockMask and calls ``flex_attention``; everything that changes per step (q/k/v, intervals,
tables) is a tensor argument of that function, so a new step is new data, not new code.
Where it still recompiles: a new head_dim, dtype, GQA ratio, scale, softcap or ``return_lse``
(all fixed per model), and the shape specializations the installed torch's flex lowering keeps.
Measured on torch 2.11 (H200, the bench's recompile probe): after the standard scenarios, the
first step with lengths not a multiple of 128 built one more graph; the next steps (other
lengths, multiples of 128 or not) built none. The price of no recompiles: torch's dynamic-shape
flex kernel cannot prove lengths divisible by its 128 block and checks bounds on every load,
5-16% slower than a static-shape compile on S0-S4 (``SPANATTN_FLEX_DYNAMIC=0`` matches the
static peer within 1%; benchmarks/gpu_flex.py).

Isolation: flex multiplies each tile's probabilities by all of its value rows, so a tile holding
two sequences would turn a neighbour's NaN or Inf into NaN (``0 * NaN``). On CUDA the step runs
in the aligned layout (aligned.py: every sequence on its own 128-row query and key tiles; q, k, v
are copied there when some sequence is not a whole number of tiles long). CPU runs flex's eager
path, which materializes the scores over every key it is given and ignores the block tables, so
it runs one sequence at a time.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch

from ..aligned import aligned_layout, aligned_tile_tables, scatter_rows
from ..tiles import build_tile_tables

BLOCK_M = BLOCK_N = 128  # flex's sparse block size; its kernel tiles divide it


def unavailable(q, plan, **opts) -> str | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FlexAttention (needs torch >= 2.5)"
    if q.dtype == torch.float64:
        return "the flex backend computes in float16/bfloat16/float32, not float64"
    if q.device.type not in ("cuda", "cpu"):
        return f"flex backend runs on cuda or cpu, not {q.device.type}"
    d = q.shape[-1]
    if q.is_cuda and d > 256:
        # head_dim 512 needs more shared memory than Hopper has (docs/design.md section 10, S5)
        return f"compiled FlexAttention does not fit head_dim {d} > 256 in shared memory"
    if d < 16 or d & (d - 1):
        return f"FlexAttention needs a power-of-two head_dim >= 16, got {d}"
    return None


# Eager calls with inputs that require grad differentiate through FlexAttention's own backward
# (its compiled kernels, from the BlockMask's query-side tables); under torch.compile the op has
# no backward of flex's to call, and auto takes another backend there.
NATIVE_AUTOGRAD = True


def no_backward(q, plan, **opts) -> str | None:
    if not q.is_cuda:
        return "torch's FlexAttention has no backward on CPU"
    return None


def prepare(plan, head_dim: int | None = None) -> None:
    """Build what a step needs once per plan (cached on it): the tile tables and intervals of
    the aligned layout. Flex's blocks do not depend on head_dim."""
    if plan.device.type == "cuda":
        aligned_tile_tables(plan, BLOCK_M, BLOCK_N)


@functools.cache
def _from_kv_blocks_extra(q_blocks: bool) -> dict:
    from torch.nn.attention.flex_attention import BlockMask

    # Without gradients, skip building the transposed (q-block) tables where torch allows it:
    # only flex's backward walks them.
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": q_blocks} if "compute_q_blocks" in params else {}


def mask_mod(alo, ahi, q_group=None, k_group=None, clamp: bool = False):
    """The step's mask over packed (or aligned) rows as a flex ``mask_mod``: the interval, two
    compares; with span groups (groups.py) also keys of the query's group (in clamp mode only
    from the interval's start on). Group ids are unique across sequences: no sequence test."""

    def interval(b, h, q_idx, kv_idx):
        return (kv_idx >= alo[q_idx]) & (kv_idx <= ahi[q_idx])

    if q_group is None:
        return interval

    def grouped(b, h, q_idx, kv_idx):
        g = q_group[q_idx]
        same = (g >= 0) & (k_group[kv_idx] == g)
        if clamp:
            same = same & (kv_idx >= alo[q_idx])
        return interval(b, h, q_idx, kv_idx) | same

    return grouped


def _flex_step(q, k, v, alo, ahi, kv_num, kv_idx, full_num, full_idx, scale, softcap, return_lse):
    """q ``[1, Hq, total_q, D]``, k/v ``[1, Hkv, total_k, D]``; tables ``[num_q_blocks(, n)]``."""
    mask = mask_mod(alo, ahi)
    return _attend(q, k, v, mask, kv_num, kv_idx, full_num, full_idx, scale, softcap, return_lse)


def _flex_group_step(
    q, k, v, alo, ahi, kv_num, kv_idx, full_num, full_idx, scale, softcap, return_lse, q_group, k_group, clamp
):
    """``_flex_step`` with span groups' ids ``q_group [total_q]``, ``k_group [total_k]``: a
    function of its own, so that torch.compile keeps its graphs apart from the group-free
    step's (dynamo caches compiled frames per code object): a plan without groups runs exactly
    the graph it ran before groups existed."""
    mask = mask_mod(alo, ahi, q_group, k_group, clamp)
    return _attend(q, k, v, mask, kv_num, kv_idx, full_num, full_idx, scale, softcap, return_lse)


def _attend(q, k, v, mask, kv_num, kv_idx, full_num, full_idx, scale, softcap, return_lse):
    from torch.nn.attention import flex_attention as fa

    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    block_mask = fa.BlockMask.from_kv_blocks(
        kv_num[None, None],
        kv_idx[None, None],
        full_num[None, None],
        full_idx[None, None],
        BLOCK_SIZE=(BLOCK_M, BLOCK_N),
        mask_mod=mask,
        seq_lengths=(q.shape[2], k.shape[2]),
        **_from_kv_blocks_extra(q.requires_grad or k.requires_grad or v.requires_grad),
    )
    kw = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": True}
    if not return_lse:
        return fa.flex_attention(q, k, v, **kw), None
    if hasattr(fa, "AuxRequest"):  # return_lse is deprecated from torch 2.9
        out, aux = fa.flex_attention(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
        return out, aux.lse
    return fa.flex_attention(q, k, v, return_lse=True, **kw)


# SPANATTN_FLEX_DYNAMIC=0 compiles per shape instead (a recompile whenever the step's lengths
# change), for torch versions whose flex lowering fails with dynamic shapes.
DYNAMIC = os.environ.get("SPANATTN_FLEX_DYNAMIC", "1") != "0"


@functools.cache
def _compiled(return_lse, groups: bool = False):
    """One compiled step per ``return_lse``, and per whether the plan has span groups."""
    step = torch.compile(_flex_group_step if groups else _flex_step, dynamic=True if DYNAMIC else False)
    return functools.partial(run_compiled, step)


# Past dynamo's recompile limit a compiled function silently runs eagerly, and flex's eager math
# materializes the scores and multiplies every value row by its zero probabilities: a neighbour's
# NaN then reaches every sequence's gradients, at O(tokens^2) memory. A model needs a handful of
# graphs (dtype, head_dim, GQA ratio, softcap, ...), a process training several models more: a
# higher limit for these steps, and an error past it instead of the eager path.
RECOMPILE_LIMIT = 64
_LIMIT_NAMES = (
    ("recompile_limit", "cache_size_limit"),  # the newer name first
    ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"),
)


def _dynamo_limits() -> dict:
    import torch._dynamo.config as cfg

    limit, fail = (next((n for n in names if hasattr(cfg, n)), None) for names in _LIMIT_NAMES)
    return {k: v for k, v in ((limit, RECOMPILE_LIMIT), (fail, True)) if k is not None}


def run_compiled(step, *args):
    """``step(*args)`` for a ``torch.compile``d flex step: never the eager fallback, and torch's
    compile failures (flex's kernels out of shared memory, the recompile limit) as one error
    naming the backend.

    >>> run_compiled(torch.compile(torch.neg, backend="eager"), torch.ones(2))
    tensor([-1., -1.])
    """
    import torch._dynamo.config as cfg

    try:
        with cfg.patch(**_dynamo_limits()):
            return step(*args)
    except Exception as e:
        kind = type(e).__name__
        if kind not in ("InductorError", "BackendCompilerFailed") and "LimitHit" not in kind:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else kind
        raise RuntimeError(
            f"flex backend: torch.compile could not build FlexAttention for this step ({kind}: {first}); "
            f"backend='triton' runs every step"
        ) from e


@functools.cache
def _softcap_tensor(value: float, device) -> torch.Tensor:
    # A 0-d tensor, not a float: under dynamic=True a float argument becomes a SymFloat, which
    # flex rejects as a score_mod buffer (seen on torch 2.11); tensors are ordinary buffers.
    return torch.tensor(value, dtype=torch.float32, device=device)


def _call(step, q, k, v, lo, hi, t, scale, softcap, return_lse, groups=None):
    # [tokens, H, D] -> [1, H, tokens, D] views; flex keeps q's stride order for its output,
    # so transposing back gives a contiguous [tokens, Hq, D] without a copy.
    grouped = () if groups is None else (groups.q_group, groups.k_group, groups.clamp)
    out, lse = step(
        *(x.transpose(0, 1)[None] for x in (q, k, v)),
        lo,
        hi,
        t.kv_num_blocks,
        t.kv_indices,
        t.full_kv_num_blocks,
        t.full_kv_indices,
        scale,
        softcap,
        return_lse,
        *grouped,
    )
    return out[0].transpose(0, 1), None if lse is None else lse[0].transpose(0, 1)


def aligned_step(step, q, k, v, plan, scale, softcap, return_lse):
    """The packed step in the aligned layout through ``step`` (compiled ``_flex_step``, or
    ``_flex_group_step`` for a plan with span groups)."""
    layout = aligned_layout(plan, BLOCK_M, BLOCK_N)
    # the plan's reused buffers would be overwritten by the next layer while autograd holds them
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    keep = None if grad else plan
    out, lse = _call(
        step,
        scatter_rows(q, layout.q, keep, "q"),
        *(scatter_rows(x, layout.k, keep, name) for x, name in ((k, "k"), (v, "v"))),
        layout.lo, layout.hi, aligned_tile_tables(plan, BLOCK_M, BLOCK_N), scale, softcap, return_lse,
        layout.groups,
    )  # fmt: skip
    if layout.q.rows is not None:
        out, lse = out[layout.q.rows], None if lse is None else lse[layout.q.rows]
    return out, lse


def forward(q, k, v, plan, *, scale, softcap=None, return_lse=False):
    if q.is_cuda:
        cap = None if softcap is None else _softcap_tensor(float(softcap), q.device)
        step = _compiled(return_lse, plan.groups is not None)
        out, lse = aligned_step(step, q, k, v, plan, scale, cap, return_lse)
    else:
        # flex's eager math runs in the input dtype (bf16 scores and probabilities, ~8x the
        # reference's error), so it gets float32 inputs like the reference; it is the slow path.
        parts, cu_q, cu_k = [], plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
        for i in range(plan.num_seqs):
            rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            lo, hi = plan.lo[rows], plan.hi[rows]
            groups = None if plan.groups is None else plan.groups.sequence(rows, keys)
            t = build_tile_tables(lo, hi, keys.stop - keys.start, BLOCK_M, BLOCK_N, groups)
            # detached: torch's CPU flex refuses inputs that require grad even under no_grad
            qi, ki, vi = (x.detach().float() for x in (q[rows], k[keys], v[keys]))
            step = _flex_step if groups is None else _flex_group_step
            parts.append(_call(step, qi, ki, vi, lo, hi, t, scale, softcap, return_lse, groups))
        out = torch.cat([o for o, _ in parts])
        lse = torch.cat([x for _, x in parts]) if return_lse else None
    out = out.to(q.dtype).contiguous()
    return out, None if lse is None else lse.float().contiguous()  # natural log, scale applied
