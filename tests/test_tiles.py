"""Tile tables equal, exactly, the tables read off the dense mask of the packed step."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # the fused Triton builder runs interpreted; set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, layers

import spanattn as sa
from spanattn.tiles import build_tile_tables, tile_tables


def packed_dense(plan: sa.Plan) -> torch.Tensor:
    """``[total_q, total_k]`` mask of the whole step: each sequence's mask on the diagonal."""
    mask = torch.zeros(plan.total_q, plan.total_k, dtype=torch.bool)
    cu_k = plan.cu_seqlens_k.tolist()
    for i in range(plan.num_seqs):
        mask[plan.seq_slice(i), cu_k[i] : cu_k[i + 1]] = plan.to_dense(i)
    return mask


def tables_from_dense(mask: torch.Tensor, bm: int, bn: int):
    """The slow way: pad with masked pairs, count allowed pairs per block, classify."""
    q, k = mask.shape
    nq, nk = -(-q // bm), -(-k // bn)
    padded = torch.zeros(nq * bm, nk * bn, dtype=torch.int64)
    padded[:q, :k] = mask
    counts = padded.view(nq, bm, nk, bn).sum(dim=(1, 3))
    full = counts == bm * bn
    partial = (counts > 0) & ~full

    def ordered(grid):
        rows = [torch.cat([grid[m].nonzero()[:, 0], (~grid[m]).nonzero()[:, 0]]) for m in range(nq)]
        return grid.sum(-1).int(), torch.stack(rows).int()

    return ordered(partial), ordered(full)


def assert_tables_match(plan: sa.Plan, bm: int, bn: int):
    t = tile_tables(plan, bm, bn)
    (num, idx), (full_num, full_idx) = tables_from_dense(packed_dense(plan), bm, bn)
    assert torch.equal(t.kv_num_blocks, num)
    assert torch.equal(t.kv_indices, idx)
    assert torch.equal(t.full_kv_num_blocks, full_num)
    assert torch.equal(t.full_kv_indices, full_idx)


@settings(max_examples=60, deadline=None)
@given(
    batch=batches(),
    layer=layers(),
    bm=st.sampled_from([16, 32, 64, 128]),
    bn=st.sampled_from([16, 64, 80, 112, 128]),  # 80, 112: FA4's key tiles at d256, d192
)
def test_tables_equal_dense_random(batch, layer, bm, bn):
    assert_tables_match(sa.plan(batch, layer), bm, bn)


@pytest.mark.parametrize(
    "seqs, layer",
    [
        ([sa.Seq(300, spans=[(20, 150)])], sa.LayerMask(window=64, spans="clamp")),  # image wider than W
        ([sa.Seq(256, spans=[(127, 128)])], sa.LayerMask(window=32, spans="on")),  # span across a tile edge
        ([sa.Seq(1, kv_len=k) for k in (5, 130, 77, 300)], sa.LayerMask()),  # decode rows share a block
        ([sa.Seq(100, kv_len=450, causal=False), sa.Seq(129)], sa.LayerMask(window=40)),
        ([sa.Seq(128), sa.Seq(128)], sa.LayerMask(spans="off")),  # everything on tile edges
    ],
)
def test_tables_equal_dense_edges(seqs, layer):
    for bm, bn in ((128, 128), (64, 32), (16, 128), (128, 80)):  # 80: FA4's d256 key tile
        assert_tables_match(sa.plan(sa.Batch(seqs), layer), bm, bn)


def test_tables_equal_create_block_mask():
    """Same tables as FlexAttention's own builder evaluating the interval mask pair by pair."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    batch = sa.Batch(
        [sa.Seq(q_len=300, kv_len=700, spans=[(410, 611)]), sa.Seq(5), sa.Seq(260, causal=False)]
    )
    plan = sa.plan(batch, sa.LayerMask(window=100, spans="clamp"))
    alo, ahi = plan.packed_intervals()

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= alo[q_idx]) & (kv_idx <= ahi[q_idx])

    ref = flex.create_block_mask(mask_mod, None, None, plan.total_q, plan.total_k, device="cpu")
    t = tile_tables(plan)
    assert torch.equal(t.kv_num_blocks, ref.kv_num_blocks[0, 0])
    assert torch.equal(t.kv_indices, ref.kv_indices[0, 0])
    assert torch.equal(t.full_kv_num_blocks, ref.full_kv_num_blocks[0, 0])
    assert torch.equal(t.full_kv_indices, ref.full_kv_indices[0, 0])


def test_tables_are_cached_and_skip_empty_blocks():
    plan = sa.plan(sa.Batch([sa.Seq(1024, spans=[(200, 455)])]), sa.LayerMask(window=128, spans="clamp"))
    t = tile_tables(plan)
    assert tile_tables(plan) is t
    assert tile_tables(plan, 64, 64) is not t
    # sliding window: at most 2-3 KV blocks per query block outside the image, never all 8
    assert int((t.kv_num_blocks + t.full_kv_num_blocks).max()) <= 4
    assert t.visited_blocks() < 8 * 8


def test_packed_intervals_stay_in_their_sequence():
    plan = sa.plan(sa.Batch([sa.Seq(7, kv_len=20), sa.Seq(3, causal=False)]), sa.LayerMask())
    alo, ahi = plan.packed_intervals()
    assert alo.tolist() == [0] * 7 + [20] * 3
    assert ahi.tolist() == list(range(13, 20)) + [22] * 3


def test_build_from_raw_intervals():
    # two rows of one 4-row block: the block is never full (short block), both KV blocks partial
    t = build_tile_tables(torch.tensor([0, 0]), torch.tensor([3, 7]), 8, BLOCK_M=4, BLOCK_N=4)
    assert t.kv_num_blocks.tolist() == [2] and t.full_kv_num_blocks.tolist() == [0]


@settings(max_examples=15, deadline=None)
@given(batch=batches(), layer=layers(), bm=st.sampled_from([32, 128]), bn=st.sampled_from([32, 80, 128]))
def test_fused_triton_tables_equal_torch(batch, layer, bm, bn):
    """tiles_triton.py (one launch, the CUDA default) builds the same tables and intervals."""
    pytest.importorskip("triton")
    from spanattn import tiles_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    if dev == "cpu" and type(tiles_triton._tile_tables_kernel).__name__ != "InterpretedFunction":
        importlib.reload(tiles_triton)  # imported before the interpreter was switched on
    plan_torch, plan_fused = sa.plan(batch, layer, dev), sa.plan(batch, layer, dev)
    want, got = tile_tables(plan_torch, bm, bn, fused=False), tile_tables(plan_fused, bm, bn, fused=True)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    for a, b in zip(plan_torch.packed_intervals(), plan_fused.packed_intervals()):
        assert torch.equal(a, b)
