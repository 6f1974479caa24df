"""The aligned layout, exactly: the step's mask moved onto rows where no tile holds two sequences,
and its tile tables equal to the tables read off that dense mask."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, layers
from test_tiles import packed_dense, tables_from_dense

import spanattn as sa
from spanattn.aligned import aligned_layout, aligned_tile_tables, scatter_rows


def _seq_of(rows: torch.Tensor | None, cu: torch.Tensor, num: int) -> torch.Tensor:
    """Sequence of each aligned row (-1 for padding)."""
    total = int(cu[-1])
    rows = torch.arange(total) if rows is None else rows
    owner = torch.full((num,), -1)
    owner[rows] = torch.searchsorted(cu[1:], torch.arange(total), right=True)
    return owner


@settings(max_examples=60, deadline=None)
@given(batch=batches(), layer=layers(), bm=st.sampled_from([16, 64, 128]), bn=st.sampled_from([16, 80, 128]))
def test_aligned_layout_is_the_mask_on_tiles_of_one_sequence(batch, layer, bm, bn):
    p = sa.plan(batch, layer)
    lay = aligned_layout(p, bm, bn)
    assert lay.q.num % bm == 0 or lay.q.rows is None
    # the dense mask in aligned coordinates, from the layout's intervals
    keys = torch.arange(lay.k.num)
    dense = (lay.lo[:, None] <= keys) & (keys <= lay.hi[:, None])
    moved = torch.zeros(lay.q.num, lay.k.num, dtype=torch.bool)
    qr = torch.arange(p.total_q) if lay.q.rows is None else lay.q.rows
    kr = torch.arange(p.total_k) if lay.k.rows is None else lay.k.rows
    moved[qr[:, None], kr[None, :]] = packed_dense(p)
    assert torch.equal(dense, moved)
    # no tile holds rows of two sequences
    if lay.copies:
        for rows, cu, num, block in (
            (lay.q.rows, p.cu_seqlens_q, lay.q.num, bm),
            (lay.k.rows, p.cu_seqlens_k, lay.k.num, bn),
        ):
            owner = _seq_of(rows, cu.long(), num)
            tiles = torch.nn.functional.pad(owner, (0, -num % block), value=-1).view(-1, block)
            real = tiles.where(tiles >= 0, tiles.max(1, keepdim=True).values)
            assert torch.equal(real.min(1).values, real.max(1).values)
    t = aligned_tile_tables(p, bm, bn)
    (num, idx), (full_num, full_idx) = tables_from_dense(dense, bm, bn)
    assert torch.equal(t.kv_num_blocks, num) and torch.equal(t.kv_indices, idx)
    assert torch.equal(t.full_kv_num_blocks, full_num) and torch.equal(t.full_kv_indices, full_idx)


def test_aligned_packing_copies_only_when_a_boundary_falls_inside_a_tile():
    layer = sa.LayerMask()
    one = sa.plan(sa.Batch([sa.Seq(q_len=100, kv_len=300)]), layer)
    whole = sa.plan(sa.Batch([sa.Seq(q_len=128, kv_len=256), sa.Seq(q_len=5, kv_len=9)]), layer)
    assert not aligned_layout(one, 128, 128).copies and not aligned_layout(whole, 128, 128).copies
    split = sa.plan(sa.Batch([sa.Seq(q_len=128, kv_len=250), sa.Seq(q_len=5, kv_len=9)]), layer)
    lay = aligned_layout(split, 128, 128)
    assert lay.q.rows is None and lay.k.rows.tolist() == list(range(250)) + list(range(256, 265))
    x = torch.arange(259.0)[:, None]
    assert torch.equal(scatter_rows(x, lay.k)[250:256], torch.zeros(6, 1))


def test_rows_scattered_into_a_plan_buffer_equal_a_new_tensor_every_call():
    """The fa4 and flex paths scatter into buffers kept on the plan (one op per call): each
    call's result equals a fresh scatter, the gaps stay zero, the buffer is the same object."""
    plan = sa.plan(sa.Batch([sa.Seq(q_len=7, kv_len=40), sa.Seq(q_len=3, kv_len=21)]), sa.LayerMask())
    lay = aligned_layout(plan, 16, 16)
    kept = []
    for seed in range(3):
        x = torch.randn(61, 2, 8, generator=torch.Generator().manual_seed(seed))
        got = scatter_rows(x, lay.k, plan, "k")
        assert torch.equal(got, scatter_rows(x, lay.k)) and not got[lay.k.gaps].any()
        kept.append(got)
    assert kept[0] is kept[1] is kept[2]
    assert scatter_rows(x, lay.k, plan, "v") is not kept[0]  # one buffer per name
