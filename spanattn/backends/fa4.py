"""FlashAttention-4 lowering (optional: ``pip install flash-attn-4``, imported only when chosen).

Two paths, picked per plan:

- built-in: when every sequence is causal and no span is active, the plan's mask IS FA4's own
  bottom-right causal mask (a sliding window of W keys is ``window_size=(W - 1, 0)``), so the
  step goes to ``flash_attn_varlen_func`` unchanged: FA4's fastest path, nothing to build.
- sparse: otherwise the packed step is ONE sequence of queries by ``total_k`` keys (as in the
  flex backend) with an interval ``mask_mod`` (``alo[q] <= kv <= ahi[q]``, read from aux
  tensors as ``alo`` and ``ahi - alo``: one unsigned compare per score) and FA4 block-sparse
  tensors made from tile tables at FA4's own tile shape: FULL tiles run without the mask,
  PARTIAL tiles run ``mask_mod``, the rest are never loaded.
  Intervals never leave their sequence, so no sequence-id check is needed. Each sequence's
  queries start on a query-tile boundary (padding rows with an empty interval where a length is
  not a multiple of the tile): a tile shared by many short sequences (decode rows beside a
  chunk) would otherwise visit the keys of all of them, for every row.

The sparse path uses FA4's fixed-length (batch 1) block sparsity rather than its varlen form: the
packed tables already exist, are tested exact (tiles.py), and need no per-sequence offsets.
Its tile shape is FA4's SM90 choice (128 queries by 128/112/80 keys for head_dim <= 128 / 192 /
256), so it runs on SM90 only; the built-in path runs wherever FA4 does.
"""

from __future__ import annotations

import functools

import torch

from ..tiles import build_tile_tables, packed_intervals, tile_tables

BLOCK_M = 128  # FA4's SM90 query tile; its block sparsity needs a multiple of it
# A row that holds no query: its start lies past every key, so ``kv - lo`` wraps to at least
# 2**31 as an unsigned number, above its width 0.
EMPTY_LO = 2**31 - 1


def _kv_tile(head_dim: int, windowed: bool = False) -> int:
    """The key tile of the sparse path: FA4's SM90 choice for the head_dim (its sparse KV block
    must be a multiple of the tile, and a smaller block shrinks the tile to match). At d256 a
    sliding-window layer takes 64 like FA4's own local path: less of each window edge tile is
    wasted."""
    if head_dim <= 128:
        return 128
    if head_dim <= 192:
        return 112
    return 64 if windowed else 80


def builtin(plan) -> bool:
    """Is the plan's mask FA4's own causal (or causal sliding-window) mask?"""
    seqs = plan.batch.seqs
    no_spans = plan.layer.spans == "off" or not any(s.spans for s in seqs)
    return no_spans and all(s.causal for s in seqs)


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
    major = torch.cuda.get_device_capability(q.device)[0]
    if not builtin(plan) and major != 9:
        return f"the sparse path uses FA4's SM90 tile shapes; this GPU is sm_{major}x"
    return None


def auto_declines(q, plan, **opts) -> str | None:
    """Why ``backend="auto"`` should pass over fa4 although it could run (then triton runs it):

    - decode-shaped steps (every q_len tiny): triton's split-KV kernel reads each K/V byte once
      per KV head across many programs; FA4 would give each (sequence, head) one 128-row tile;
    - sparse-path steps whose sequences need padding to own their query tiles (short rows
      beside chunks): measured on the H200 (chunks with images + 64 decode rows + canvases),
      fa4 ran 1.02x (global) and 1.29x (sliding) triton's time there; its tiles run in a fixed
      order, triton's longest first.
    """
    try:
        from .triton.decode import MAX_Q_LEN
    except ImportError:  # no triton: nothing better to go to
        return None
    if plan.max_seqlen_q <= MAX_Q_LEN:
        return f"decode-shaped step (q_len <= {MAX_Q_LEN}): the split-KV kernel suits it better"
    if not builtin(plan) and not _tile_aligned(plan):
        return "short sequences share the step with chunks: triton's longest-first tile order suits it better"
    return None


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


def _tile_aligned(plan) -> bool:
    """Does every sequence already start on a query-tile boundary in the packed layout?"""
    return all(s.q_len % BLOCK_M == 0 for s in plan.batch.seqs[:-1])


def query_rows(plan) -> tuple[torch.Tensor | None, int]:
    """``(rows, num_rows)``: the row of each packed query in FA4's query layout, where every
    sequence starts on a tile boundary; ``rows`` is None when the packed layout already does
    (every sequence but the last a multiple of the tile long: the standard scenarios)."""
    seqs = plan.batch.seqs
    if _tile_aligned(plan):
        return None, plan.total_q

    def build():
        padded = (plan.cu_seqlens_q.diff() + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = torch.cumsum(padded, 0) - padded
        seq = plan.query_seq_ids()
        local = torch.arange(plan.total_q, device=plan.device) - plan.cu_seqlens_q[seq]
        return starts[seq] + local

    return plan.cached("fa4_query_rows", build), sum(-(-s.q_len // BLOCK_M) * BLOCK_M for s in seqs)


def sparse_inputs(plan, head_dim: int):
    """The sparse path's inputs, cached on the plan: the tile tables at FA4's tile shape and the
    packed intervals in FA4's query layout (``query_rows``) as ``[lo, width = hi - lo]``, every
    other row holding the empty interval ``(EMPTY_LO, 0)``. A tile past the last has them too:
    FA4 evaluates ``mask_mod`` on every row of a short last tile, and with GQA heads packed into
    tiles (FA4's default) those rows reach past it by up to a tile."""
    block_n = _kv_tile(head_dim, plan.layer.window is not None)

    def build():
        rows, num_rows = query_rows(plan)
        alo, ahi = packed_intervals(plan)
        size = (-(-num_rows // BLOCK_M) + 1) * BLOCK_M
        lo = torch.full((size,), EMPTY_LO, dtype=torch.int32, device=alo.device)
        width = torch.zeros(size, dtype=torch.int32, device=alo.device)
        if rows is None:
            t = tile_tables(plan, BLOCK_M, block_n)  # one launch on CUDA
            lo[: plan.total_q], width[: plan.total_q] = alo, ahi - alo
        else:
            lo[rows], width[rows] = alo, ahi - alo
            tile_lo = torch.zeros(num_rows, dtype=torch.int32, device=alo.device)
            tile_hi = torch.full((num_rows,), -1, dtype=torch.int32, device=alo.device)  # touches no block
            tile_lo[rows], tile_hi[rows] = alo, ahi
            t = build_tile_tables(tile_lo, tile_hi, plan.total_k, BLOCK_M, block_n)
        return t, [lo, width]

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
    """Build the sparse path's tables once per plan (nothing for the built-in path)."""
    if not builtin(plan):
        sparse_inputs(plan, head_dim)


def forward(q, k, v, plan, *, scale, softcap=None, return_lse=False):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    common = {"softmax_scale": scale, "softcap": softcap or 0.0, "return_lse": return_lse}
    # FA4 was checked here on contiguous packed tensors; strided views (transformers' [B, H, S, D]
    # seen as [S, H, D]) are copied first rather than trusted to its layout handling.
    q, k, v = (t.contiguous() for t in (q, k, v))
    if builtin(plan):
        w = plan.layer.window
        out, lse = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            causal=True,
            window_size=(None, None) if w is None else (w - 1, 0),
            **common,
        )  # lse [Hq, total_q]
    else:
        tables, aux = sparse_inputs(plan, q.shape[-1])
        rows, num_rows = query_rows(plan)
        if rows is not None:  # each sequence on its own query tiles; padding rows are discarded
            q = q.new_zeros(num_rows, *q.shape[1:]).index_copy_(0, rows, q)
        out, lse = flash_attn_func(
            q[None],
            k[None],
            v[None],
            causal=False,
            pack_gqa=_pack_gqa(q, k),
            mask_mod=_interval_mask_mod(),
            aux_tensors=aux,
            block_sparse_tensors=_block_sparse(tables),
            **common,
        )
        out, lse = out[0], None if lse is None else lse[0]  # lse [1, Hq, rows] -> [Hq, rows]
        if rows is not None:
            out, lse = out[rows], None if lse is None else lse[:, rows]
    if not return_lse:
        return out, None  # FA4 may hand back the LSE it keeps for backward anyway
    return out, lse.transpose(0, 1).float().contiguous()
