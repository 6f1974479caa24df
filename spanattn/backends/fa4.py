"""FlashAttention-4 lowering (optional: ``pip install flash-attn-4``, imported only when chosen).

Two paths, picked per plan:

- built-in: when no span is active, the plan's mask IS FA4's own bottom-right causal mask for
  causal sequences (a sliding window of W keys is ``window_size=(W - 1, 0)``) and its
  non-causal one for the others (``(W - 1, W - 1)``, ``(W, W)`` for inclusive windows), so the
  step goes to ``flash_attn_varlen_func`` unchanged when all sequences share a flag: FA4's
  fastest path, nothing to build; a step of both flags takes one launch per flag into one
  output (fa4_flags.py).
- sparse: otherwise the packed step is ONE sequence of queries by keys (as in the flex
  backend) with an interval ``mask_mod`` (``alo[q] <= kv <= ahi[q]``, read from aux tensors as
  ``alo`` and ``ahi - alo``: one unsigned compare per score) and FA4 block-sparse tensors made
  from tile tables at FA4's own tile shape: FULL tiles run without the mask, PARTIAL tiles run
  ``mask_mod``, the rest are never loaded. Intervals never leave their sequence, so no
  sequence-id check is needed. Span groups (groups.py) add each row's and key's group id as two
  more aux tensors, read by a second ``mask_mod`` only for plans that have them: a key of the
  row's group passes too (in clamp mode from ``lo`` on); the tile tables list the tiles of a
  group's other spans, FULL where every pair of the tile is allowed.

Isolation. FA4's SM90 kernel reads whole key tiles and multiplies masked probabilities (0) by
every value row of the tile, and ``0 * NaN`` is NaN: a tile holding two sequences' keys lets one
request's NaN or Inf into its neighbour's output (also on the built-in path, whose varlen tiles
run past a sequence's end into the next one). So every step runs in a layout where no tile holds
two sequences (aligned.py): the sparse path puts each sequence on its own query and key tiles,
the built-in path starts each sequence's keys on a key-tile boundary with zeros after its end.
Where the packed layout already is one (a single sequence, or every sequence but the last a
whole number of tiles long: the standard single-prompt scenarios) nothing moves; otherwise q
and/or k, v are copied into it, and ``backend="auto"`` leaves such steps to triton, whose kernels
never read another sequence's rows.

Host time. A call's arguments to FA4 other than q, k, v are the plan's (tables, aux tensors,
lengths), built once per plan; FA4's Python interface still derives its kernel's arguments from
them on every call (0.2-0.3 ms on an H200, more than a small step's kernel). So the first call
of a plan records FA4's compiled call and later calls make it themselves (fa4_direct.py),
checked bit for bit against FA4's own call once per kernel, and left to FA4's interface
wherever the recording does not fit.

The sparse path uses FA4's fixed-length (batch 1) block sparsity rather than its varlen form: the
packed tables already exist and are tested exact (tiles.py, aligned.py). Tile shapes are FA4's
SM90 choices (128 queries by 128/112/80 keys for head_dim <= 128 / 192 / 256, 64 at 256 with a
window), so the sparse path runs on SM90 only, and so does a multi-sequence built-in step whose
sequences must be moved onto FA4's key tiles (they are known for SM90 only).
"""

from __future__ import annotations

import functools
import sys

import torch

from ..aligned import aligned_layout, aligned_tile_tables, padded_rows, scatter_rows
from . import fa4_flags
from .fa4_direct import DirectCall

BLOCK_M = 128  # FA4's SM90 query tile; its block sparsity needs a multiple of it
SM90 = (9, 0)
# A row that holds no query: its start lies past every key, so ``kv - lo`` wraps to at least
# 2**31 as an unsigned number, above its width 0.
EMPTY_LO = 2**31 - 1


def _kv_tile(head_dim: int, windowed: bool = False, builtin: bool = False) -> int:
    """FA4's SM90 key tile for the head_dim (query and value head_dims equal). The sparse path
    runs FA4 without its window (the block is ours: a multiple of the tile, and a smaller block
    shrinks the tile to match), taking 64 at d256 on sliding layers like FA4's own local path
    (less of each window edge tile wasted); the built-in path with a window takes FA4's local
    tiles, 96 at d <= 192."""
    if head_dim <= 128:
        return 128
    if head_dim <= 192:
        return 96 if windowed and builtin else 112
    return 64 if windowed else 80


def builtin(plan) -> bool:
    """Is the plan's mask FA4's own (causal or not per sequence, with or without a window)?"""

    def build():  # once per plan: every call asks
        return plan.layer.spans == "off" or not any(s.spans for s in plan.batch.seqs)

    return plan.cached("fa4_builtin", build)


@functools.cache
def _import_error() -> str | None:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # a missing or broken install both mean "cannot run here"
        return f"flash_attn.cute does not import ({type(e).__name__}: {e}); pip install flash-attn-4"
    return None


def unavailable(q, plan, **opts) -> str | None:
    if not q.is_cuda:
        return "FA4 runs on CUDA only"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FA4 computes in float16/bfloat16 only, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"FA4 supports head_dim a multiple of 8 up to 256 (SM90), got {d}"
    if _import_error():
        return _import_error()
    cap = torch.cuda.get_device_capability(q.device)
    if cap != SM90 and not builtin(plan):
        return f"the sparse path uses FA4's SM90 tile shapes; this GPU is sm_{cap[0]}{cap[1]}"
    if cap != SM90 and plan.num_seqs > 1:
        return "several sequences in a step are kept apart on FA4's SM90 key tiles only"
    if builtin(plan) and len(fa4_flags.flags(plan)) > 1 and fa4_flags.inner_forward() is None:
        return f"causal and non-causal sequences: this FA4's _flash_attn_fwd lacks one of {fa4_flags.NEEDS}"
    return None


def no_backward(q, plan, **opts) -> str | None:
    """Gradients come from FA4's own backward (``backward``) on its own masks of one sequence: no
    active span (its block-sparse backward takes no varlen step, and our sparse path's tables
    are the forward's), and no neighbour in the step (its backward tiles, 48 to 128 keys and 64
    to 128 queries by head_dim, would read across a sequence's end where no layout of ours keeps
    them apart, and a masked 0 times a neighbour's NaN is NaN)."""
    if not builtin(plan):
        return "FA4's backward takes no span mask over a packed step (triton trains it)"
    if plan.num_seqs > 1:
        return "FA4's backward tiles would cross the step's sequences (triton trains it)"
    return None


def backward(q, k, v, out, lse, dout, plan, *, scale, softcap=None, dlse=None):
    """FA4's varlen backward (deterministic) on the built-in path's step (``no_backward``)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    causal = fa4_flags.flags(plan)[0]
    left, right = fa4_flags.window(plan, causal)
    fa4_rows = lambda t: None if t is None else t.transpose(0, 1).contiguous()  # FA4's LSE is [Hq, rows]
    dq, dk, dv = _flash_attn_bwd(
        q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), dout.contiguous(), fa4_rows(lse),
        scale, causal, softcap or 0.0, window_size_left=left, window_size_right=right,
        cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_k=plan.max_seqlen_k, deterministic=True, dlse=fa4_rows(dlse),
    )  # fmt: skip
    return dq, dk, dv


def auto_declines(q, plan, **opts) -> str | None:
    """Why ``backend="auto"`` should pass over fa4 although it could run (then triton runs it):

    - decode-shaped steps (every q_len tiny): triton's split-KV kernel reads each K/V byte once
      per KV head across many programs; FA4 would give each (sequence, head) one 128-row tile;
    - steps whose sequences must be copied onto tiles of their own (``copies``): the copy costs
      a read and write of q or K/V, and triton's kernels never read another sequence's rows
      without one (measured on the H200: chunks with images + decode rows + canvases ran 1.02x
      (global) and 1.29x (sliding) triton's time on fa4 with the query copy alone);
    - steps with span groups: the group ``mask_mod`` reads a key's group per score on every
      PARTIAL tile; on the H200's 64-frame video steps fa4 ran 0.98x triton's time on the
      global layer but 1.07x on the clamped one, and its group tables took 5.2-5.5 ms to build
      against triton's 2.4-2.7 (results/2026-12-01-groups-all-backends-h200.json);
    - steps that triton's Gluon kernels run faster (``gluon_runs_faster``).
    """
    try:
        from .triton.decode import MAX_Q_LEN
    except ImportError:  # no triton: nothing better to go to
        return None
    if plan.max_seqlen_q <= MAX_Q_LEN:
        return f"decode-shaped step (q_len <= {MAX_Q_LEN}): the split-KV kernel suits it better"
    if plan.groups is not None:
        return "span groups: triton's Gluon kernels walk them without a per-score lookup of key groups"
    faster = gluon_runs_faster(q, plan)  # before copies: it builds no layout
    if faster:
        return faster
    if copies(plan, q.shape[-1]):
        return "sequences would be copied onto tiles of their own; triton keeps them apart without a copy"
    return None


# Both backends through ``attention``, alternating on the H200, four calls (results/2026-12-04-
# auto-choice-*-h200.json), triton's time over fa4's in blocks and in turns. Steps with active
# spans (the sparse path): sliding layers S1 d128 / d256 0.90-0.94 / 0.93-0.95 (32k tokens),
# 0.90-0.98 / 0.95-0.96 (8k); global layers at d256 0.95-0.98 (32k), 0.88-0.91 (8k); at d128
# 1.01-1.03 (32k: rows walk 16k keys on average), 0.96-0.99 (16k: 8k keys), 0.92-0.94 (8k). FA4
# deals a mask_mod call's tiles in ascending order (the longest last) and pays each launch's
# tail; the persistent Gluon kernels deal the longest first and halve a short step's last
# items. FA4's own kernels (no span active) stay: S1's tokens without images at d128 0.97-0.99
# (32k) but 1.03-1.17 (8k), at d256 1.00-1.02 / 1.04-1.08; plain causal (S0) 1.00-1.05; S4 1.02-1.03.
LONG_WALK = 12288


def gluon_runs_faster(q, plan) -> str | None:
    """Why triton would run this sparse-path step faster, on a Gluon kernel (None: fa4 is not
    slower, or the step is FA4's own mask): a sliding layer, a head_dim above 128 or rows
    walking fewer than ``LONG_WALK`` keys on average."""
    if builtin(plan):
        return None
    try:
        from .triton import gluon_runs_for
        from .triton.configs import pick_gluon
    except ImportError:  # no triton
        return None
    cfg = pick_gluon(q.shape[-1], q.dtype)
    if cfg is None or not gluon_runs_for(q, plan, cfg):
        return None
    faster = "triton's Gluon kernels run it faster"
    if plan.layer.window is not None or q.shape[-1] > 128:
        return f"spans on a sliding layer or at head_dim {q.shape[-1]} > 128: {faster}"
    if fa4_flags.mean_walk(plan.batch.seqs, plan.layer) < LONG_WALK:
        return f"spans on rows walking under {LONG_WALK} keys on average: {faster}"
    return None


def copies(plan, head_dim: int) -> bool:
    """Must the step's q or K/V be copied so that no FA4 tile holds two sequences?"""
    if builtin(plan):
        return _builtin_keys(plan, head_dim)[0].rows is not None
    return sparse_layout(plan, head_dim).copies


@functools.cache
def _interval_mask_mod():
    """One module-level ``mask_mod`` (FA4 caches compiled kernels by its hash)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.utils import scalar_to_ssa

    @cute.jit
    def interval_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        # lo <= kv <= lo + width as ONE unsigned compare (keys below lo wrap above any width):
        # at d128 the mask is the partial tiles' bottleneck, and two signed compares and an AND
        # ran S1 3% slower (measured on the H200). Rows that hold no query read (EMPTY_LO, 0).
        lo = scalar_to_ssa(aux_tensors[0][q_idx[0]], cutlass.Int32)
        width = scalar_to_ssa(aux_tensors[1][q_idx[0]], cutlass.Int32)
        return (kv_idx - lo).to(cutlass.Uint32) <= width.to(cutlass.Uint32)

    return interval_mask


@functools.cache
def _group_mask_mod(clamp: bool):
    """The interval ``mask_mod`` or a key of the row's span group (aux tensors 2 and 3: the
    row's group, -2 where none, and the key's, -1 where none, so that only real groups match);
    in clamp mode group keys from ``lo`` on. One per mode, module-level, as above."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.utils import scalar_to_ssa

    @cute.jit
    def group_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        lo = scalar_to_ssa(aux_tensors[0][q_idx[0]], cutlass.Int32)
        width = scalar_to_ssa(aux_tensors[1][q_idx[0]], cutlass.Int32)
        row_group = scalar_to_ssa(aux_tensors[2][q_idx[0]], cutlass.Int32)
        key_group = scalar_to_ssa(aux_tensors[3][kv_idx[0]], cutlass.Int32)
        same = key_group == row_group
        if cutlass.const_expr(clamp):
            same = same & (kv_idx >= lo)
        return ((kv_idx - lo).to(cutlass.Uint32) <= width.to(cutlass.Uint32)) | same

    return group_mask


def sparse_layout(plan, head_dim: int):
    """The sparse path's aligned layout (aligned.py): each sequence on its own query and key tiles."""
    return aligned_layout(plan, BLOCK_M, _kv_tile(head_dim, plan.layer.window is not None))


def sparse_inputs(plan, head_dim: int):
    """The sparse path's inputs, cached on the plan: the tile tables of its aligned layout and
    the intervals in that layout as ``[lo, width = hi - lo]``, every row that holds no query
    carrying the empty interval ``(EMPTY_LO, 0)``. A tile past the last has them too: FA4
    evaluates ``mask_mod`` on every row of a short last tile, and with GQA heads packed into
    tiles (FA4's default) those rows reach past it by up to a tile. With span groups, also the
    rows' groups (-2 where none) and the keys' (-1 where none, and a tile past the last key)."""
    block_n = _kv_tile(head_dim, plan.layer.window is not None)

    def build():
        layout = aligned_layout(plan, BLOCK_M, block_n)
        size = (-(-layout.q.num // BLOCK_M) + 1) * BLOCK_M
        lo = torch.full((size,), EMPTY_LO, dtype=torch.int32, device=layout.lo.device)
        width = torch.zeros(size, dtype=torch.int32, device=layout.lo.device)
        real = layout.hi >= layout.lo
        lo[: layout.q.num] = torch.where(real, layout.lo, EMPTY_LO)
        width[: layout.q.num] = torch.where(real, layout.hi - layout.lo, 0)
        aux = [lo, width]
        g = layout.groups
        if g is not None:
            row_group = torch.full_like(lo, -2)
            row_group[: layout.q.num] = torch.where(real & (g.q_group >= 0), g.q_group, -2)
            key_group = torch.full(((-(-layout.k.num // block_n) + 1) * block_n,), -1, dtype=torch.int32,
                                   device=lo.device)  # fmt: skip
            key_group[: layout.k.num] = g.k_group
            aux += [row_group, key_group]
        return aligned_tile_tables(plan, BLOCK_M, block_n), aux

    return plan.cached(("fa4_sparse", block_n), build)


def _block_sparse(t):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    # [batch 1, heads broadcast, query tiles(, key tiles)]: one table for every head
    return BlockSparseTensorsTorch(
        mask_block_cnt=t.kv_num_blocks[None, None],
        mask_block_idx=t.kv_indices[None, None],
        full_block_cnt=t.full_kv_num_blocks[None, None],
        full_block_idx=t.full_kv_indices[None, None],
        block_size=(t.BLOCK_M, t.BLOCK_N),
    )


def _pack_gqa(q, k) -> bool:
    """Put the query heads that share a K/V head into one tile (loads K/V once for them)?
    Measured on the H200 (S1-S4, GQA 2): faster at d256 (S2 -5%, S1 -2%), slower at d128
    (S1 +9%, S4 +11%): at d256 K/V traffic weighs more against the tile's math."""
    return q.shape[1] > k.shape[1] and q.shape[-1] > 128


def prepare(plan, head_dim: int) -> None:
    """Build the path's tables or layout once per plan."""
    if builtin(plan):
        _builtin_keys(plan, head_dim)
    else:
        sparse_inputs(plan, head_dim)


def _builtin_keys(plan, head_dim: int):
    """``(rows, cu_seqlens_k)`` of the built-in path's key layout: each sequence's keys from a
    key-tile boundary on, zeros up to the next (``rows.rows`` None when packed keys are that)."""
    rows = padded_rows(plan, "k", _kv_tile(head_dim, plan.layer.window is not None, builtin=True))
    if rows.rows is None:
        return rows, plan.cu_seqlens_k
    build = lambda: torch.cat([rows.starts, rows.starts.new_tensor([rows.num])]).to(torch.int32)
    return rows, plan.cached(("fa4_builtin_cu_k", rows.num), build)


def _lowering(plan, q, k):
    """``(call, q_rows, k_rows)`` of the plan at this head shape, built once per plan: the FA4
    call with its fixed arguments (fa4_direct.py: later calls skip FA4's Python interface) and
    the rows q and k, v are moved to (``q_rows`` None on the built-in path, which leaves q)."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]

    def build():
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        # the object whose compile_cache FA4's public functions call through (None: not there)
        host = getattr(sys.modules[flash_attn_func.__module__], "_flash_attn_fwd", None)
        if builtin(plan):
            rows, cu_k = _builtin_keys(plan, d)
            lengths = dict(
                cu_seqlens_q=plan.cu_seqlens_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=plan.max_seqlen_q,
                max_seqlen_k=plan.max_seqlen_k,
                seqused_k=None if rows.rows is None else plan.seq_lens,
            )  # lse [Hq, total_q]
            flags = fa4_flags.flags(plan)
            if len(flags) == 1:
                mask = dict(causal=flags[0], window_size=fa4_flags.window(plan, flags[0]))
                return DirectCall(flash_attn_varlen_func, host, **mask, **lengths), None, rows
            per_flag = lambda c: dict(causal=c, window_size=fa4_flags.window(plan, c),
                                      seqused_q=fa4_flags.used_queries(plan, c))  # fmt: skip
            fwd = fa4_flags.shared_output_forward
            calls = [DirectCall(fwd, host, **per_flag(c), **lengths) for c in flags]
            return fa4_flags.FlagLaunches(calls), None, rows
        tables, aux = sparse_inputs(plan, d)
        layout = sparse_layout(plan, d)
        call = DirectCall(
            flash_attn_func,
            host,
            causal=False,
            pack_gqa=_pack_gqa(q, k),
            mask_mod=_interval_mask_mod() if plan.groups is None else _group_mask_mod(plan.groups.clamp),
            aux_tensors=aux,
            block_sparse_tensors=_block_sparse(tables),
        )
        return call, layout.q, layout.k

    return plan.cached(("fa4_lowering", hq, hkv, d), build)


def forward(q, k, v, plan, *, scale, softcap=None, return_lse=False):
    # FA4 was checked here on contiguous packed tensors; strided views (transformers' [B, H, S, D]
    # seen as [S, H, D]) are copied first rather than trusted to its layout handling.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    call, q_rows, k_rows = _lowering(plan, q, k)
    k, v = scatter_rows(k, k_rows, plan, "k"), scatter_rows(v, k_rows, plan, "v")
    if q_rows is None:
        out, lse = call(q, k, v, scale, softcap or 0.0, return_lse)
    else:
        q = scatter_rows(q, q_rows, plan, "q")  # padding rows are discarded below
        out, lse = call(q[None], k[None], v[None], scale, softcap or 0.0, return_lse)
        out, lse = out[0], None if lse is None else lse[0]  # lse [1, Hq, rows] -> [Hq, rows]
        if q_rows.rows is not None:
            out, lse = out[q_rows.rows], None if lse is None else lse[:, q_rows.rows]
    if not return_lse:
        return out, None  # FA4 may hand back the LSE it keeps for backward anyway
    return out, lse.transpose(0, 1).float().contiguous()
