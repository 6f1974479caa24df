"""Span groups against a brute-force per-pair predicate written here from docs/design.md section 2,
independently of spanattn/intervals.py and spanattn/groups.py; the chunking rule; group-free
plans unchanged."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, grouped_batches, layers
from test_tiles import assert_tables_match, packed_dense, tables_from_dense
from tolerance import assert_close_to_truth

import spanattn as sa
from spanattn.aligned import aligned_layout, aligned_tile_tables
from spanattn.backends import reference
from spanattn.scenarios import group_check_step
from spanattn.tiles import tile_tables


def allowed(q, k, seq, layer):
    """Is key ``k`` allowed for the query at absolute position ``q``, pair by pair."""
    if not 0 <= k < seq.kv_len:
        return False
    w = layer.window
    past = w is None or q - k < w
    if seq.causal:
        base = k <= q and past
    elif w is None:
        base = True
    else:
        base = abs(q - k) < w if layer.noncausal_window == "exclusive" else abs(q - k) <= w
    if base or layer.spans == "off" or (layer.spans == "clamp" and not past):
        return base
    spans = list(zip(seq.spans, seq.groups or [None] * len(seq.spans)))
    holding = lambda pos: [(sp, g) for sp, g in spans if sp[0] <= pos <= sp[1]]
    return any(a == b or (ga is not None and ga == gb) for a, ga in holding(q) for b, gb in holding(k))


def brute_mask(seq, layer):
    return torch.tensor(
        [[allowed(seq.ctx + i, k, seq, layer) for k in range(seq.kv_len)] for i in range(seq.q_len)]
    )


@settings(max_examples=150, deadline=None)
@given(batch=grouped_batches(), layer=layers(max_window=320))
def test_plan_equals_brute_force(batch, layer):
    p = sa.plan(batch, layer)
    dense = [p.to_dense(i) for i in range(p.num_seqs)]
    for i, seq in enumerate(batch.seqs):
        assert torch.equal(dense[i], brute_mask(seq, layer)), (i, seq, layer)
    assert p.allowed_pairs() == sum(int(d.sum()) for d in dense)


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_len=200), layer=layers())
def test_group_free_plans_carry_nothing_more(batch, layer):
    """A batch without groups, or whose groups hold one span each in the step: no group tables."""
    p = sa.plan(batch, layer)
    assert p.groups is None
    singles = [
        sa.Seq(s.q_len, s.kv_len, s.spans, s.causal, s.prompt_len, groups=list(range(len(s.spans))))
        for s in batch.seqs
    ]
    p1 = sa.plan(sa.Batch(singles), layer)
    assert p1.groups is None and torch.equal(p1.lo, p.lo) and torch.equal(p1.hi, p.hi)


def test_video_frames_see_each_other_text_stays_causal():
    # three 4-token frames with 2 timestamp tokens before each: t t F F F F t t F F F F t t F F F F
    frames = [(2, 5, 0), (8, 11, 0), (14, 17, 0)]
    p = sa.plan(sa.Batch([sa.Seq(18, spans=frames)]), sa.LayerMask())
    m = p.to_dense(0)
    assert m[2, 17] and m[17, 2] and m[9, 15]  # frame tokens see every frame
    assert not m[6, 7] and not m[2, 6]  # text stays causal; frames do not see later text
    assert m[6].tolist() == [True] * 7 + [False] * 11


def test_clamp_keeps_the_window_on_the_past_side():
    frames = [(0, 3, 0), (10, 13, 0), (20, 23, 0)]
    p = sa.plan(sa.Batch([sa.Seq(24, spans=frames)]), sa.LayerMask(window=6, spans="clamp"))
    m = p.to_dense(0)
    assert m[10, 23] and m[10, 20]  # later frames: the window limits the past side only
    assert not m[12, 3] and not m[20, 13]  # earlier frames beyond the window
    assert m[13, 10] and m[15, 10]  # own frame / window: as for one span


def test_groups_are_per_sequence():
    """The same group id in two sequences names two groups: nothing crosses."""
    seqs = [sa.Seq(10, spans=[(1, 2, 0), (6, 7, 0)]), sa.Seq(10, spans=[(1, 2, 0), (6, 7, 0)])]
    p = sa.plan(sa.Batch(seqs), sa.LayerMask())
    assert p.groups.num_groups == 2
    assert p.groups.q_group.tolist()[10:] == [-1, 1, 1, -1, -1, -1, 1, 1, -1, -1]
    assert torch.equal(p.to_dense(0), p.to_dense(1))


def test_allowed_pairs_count_group_keys_once():
    p = sa.plan(sa.Batch([sa.Seq(12, spans=[(1, 3, 0), (8, 10, 0)])]), sa.LayerMask())
    assert p.allowed_pairs() == int(p.to_dense(0).sum())
    alo, ahi = p.packed_intervals()
    assert p.allowed_pairs() > int((ahi - alo + 1).sum())


def test_seq_group_forms_and_errors():
    a = sa.Seq(20, spans=[(10, 12, 1), (1, 2, 1), (5, 6)])
    b = sa.Seq(20, spans=[(10, 12), (1, 2), (5, 6)], groups=[1, 1, None])
    assert a == b and a.spans == ((1, 2), (5, 6), (10, 12)) and a.groups == (1, None, 1)
    assert sa.Seq(20, spans=[(1, 2, None)]).groups == ()
    assert "groups=(1, None, 1)" in repr(a) and "groups" not in repr(sa.Seq(4, spans=[(1, 2)]))
    with pytest.raises(ValueError, match="int >= 0"):
        sa.Seq(20, spans=[(1, 2, -1)])
    with pytest.raises(ValueError, match="int >= 0"):
        sa.Seq(20, spans=[(1, 2, True)])
    with pytest.raises(ValueError, match="not both"):
        sa.Seq(20, spans=[(1, 2, 0)], groups=[0])
    with pytest.raises(ValueError, match="1 entries for 2 spans"):
        sa.Seq(20, spans=[(1, 2), (4, 5)], groups=[0])
    with pytest.raises(TypeError, match="triple"):
        sa.Seq(20, spans=[(1, 2, 0, 4)])


@pytest.mark.parametrize(
    "q_len, kv_len, cut",
    [
        (30, 30, (10, 49, 0)),  # queries in the first image, the chunk ends before the last one
        (20, 20, (10, 49, 0)),  # the chunk ends right after the first image: still cut
        (8, 28, None),  # queries 20..27 are text between the group's spans: no query of it
        (5, 45, (40, 49, 0)),  # queries 40..44 inside the group's last span (a prefix hit before)
        (10, 50, None),  # the chunk ends with the group
    ],
)
def test_a_chunk_holding_a_group_query_must_hold_the_whole_group(q_len, kv_len, cut):
    seq = sa.Seq(q_len, kv_len, spans=[(10, 19, 0), (40, 49, 0)], prompt_len=60)
    assert seq.cut_span() == cut
    if cut is None:
        sa.Batch([seq])
        return
    with pytest.raises(ValueError, match="span group 0"):
        sa.Batch([seq])
    p = sa.plan(sa.Batch([seq], allow_split_spans=True), sa.LayerMask())
    assert torch.equal(p.to_dense(0), brute_mask(seq, sa.LayerMask()))


@pytest.mark.parametrize(
    "spans, start, budget, end",
    [
        ([(10, 265, 0), (282, 537, 0)], 0, 400, 10),  # before the group
        ([(10, 265, 0), (282, 537, 0)], 10, 400, 538),  # inside it: past its end (over budget)
        ([(10, 265, 0), (282, 537, 0)], 0, 600, 600),
        ([(10, 265, 0), (282, 537, 0)], 266, 100, 282),  # between its spans: a text-only chunk
        ([(10, 19, 0), (30, 39, 1), (50, 59, 0)], 0, 45, 10),  # interleaved groups
        ([(10, 19, 0), (30, 39, 1), (50, 59, 0)], 10, 45, 60),  # over budget: past the group
        ([(0, 9, 0), (20, 29, 1), (30, 39, 0), (60, 69, 1)], 0, 35, 70),  # hulls overlap
    ],
)
def test_max_chunk_end_with_groups(spans, start, budget, end):
    got = sa.max_chunk_end(spans, start, budget)
    assert got == end
    q_len = got - start
    seq = sa.Seq(q_len, got, spans=spans, prompt_len=max(got, max(e for _, e, _ in spans) + 1))
    assert seq.cut_span() is None


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_max_chunk_end_cuts_nothing(data):
    spans = data.draw(
        st.lists(st.tuples(st.integers(0, 200), st.integers(0, 12), st.sampled_from([None, 0, 1])))
    )
    items, pos = [], 0
    for gap, length, g in spans:  # disjoint, sorted
        items.append((pos + gap, pos + gap + length, g))
        pos += gap + length + 1
    start = data.draw(st.integers(0, pos + 5))
    budget = data.draw(st.integers(1, 300))
    end = sa.max_chunk_end(items, start, budget)
    seq = sa.Seq(end - start, end, spans=items, prompt_len=max([end] + [e + 1 for _, e, _ in items]))
    assert seq.cut_span() is None
    if end <= start + budget:  # the largest such end: every larger end in budget cuts
        for later in range(end + 1, start + budget + 1):
            s = sa.Seq(
                later - start, later, spans=items, prompt_len=max([later] + [e + 1 for _, e, _ in items])
            )
            assert s.cut_span() is not None


@pytest.mark.parametrize("layer", list(group_check_step()[1]))
def test_reference_is_softmax_over_the_predicate_and_sdpa_holds_the_rule(layer):
    batch, layers = group_check_step()
    p = sa.plan(batch, layers[layer])
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(n, 2, 16, generator=g, dtype=torch.float64) for n in (p.total_q, p.total_k, p.total_k)
    )
    out = reference.forward(q, k, v, p, scale=0.25, compute_dtype=torch.float64)[0]
    cu_k = p.cu_seqlens_k.tolist()
    for i, seq in enumerate(batch.seqs):
        keys = slice(cu_k[i], cu_k[i + 1])
        s = torch.einsum("qhd,khd->hqk", q[p.seq_slice(i)], k[keys]) * 0.25
        probs = torch.softmax(s.masked_fill(~brute_mask(seq, layers[layer]), float("-inf")), -1)
        torch.testing.assert_close(out[p.seq_slice(i)], torch.einsum("hqk,khd->qhd", probs, v[keys]))
    q, k, v = (x.float() for x in (q, k, v))
    got, lse = sa.attention(q, k, v, p, backend="sdpa", return_lse=True)
    assert_close_to_truth(got, lse, q, k, v, p)


@settings(max_examples=40, deadline=None)
@given(
    batch=grouped_batches(),
    layer=layers(max_window=320),
    bm=st.sampled_from([16, 32, 128]),
    bn=st.sampled_from([16, 64, 80]),
)
def test_tile_tables_equal_the_dense_mask(batch, layer, bm, bn):
    """A key tile holding a span of a query tile's group is visited, FULL exactly when every
    pair is allowed; in the packed layout and the aligned one (flex's)."""
    p = sa.plan(batch, layer)
    assert_tables_match(p, bm, bn)
    lay = aligned_layout(p, bm, bn)
    keys = torch.arange(lay.k.num)
    dense = (lay.lo[:, None] <= keys) & (keys <= lay.hi[:, None])
    if lay.groups is not None:
        dense |= lay.groups.dense(slice(None), slice(None), lay.lo)
    moved = torch.zeros(lay.q.num, lay.k.num, dtype=torch.bool)
    qr = torch.arange(p.total_q) if lay.q.rows is None else lay.q.rows
    kr = torch.arange(p.total_k) if lay.k.rows is None else lay.k.rows
    moved[qr[:, None], kr[None, :]] = packed_dense(p)
    assert torch.equal(dense, moved)
    t = aligned_tile_tables(p, bm, bn)
    (num, idx), (full_num, full_idx) = tables_from_dense(dense, bm, bn)
    assert torch.equal(t.kv_num_blocks, num) and torch.equal(t.kv_indices, idx)
    assert torch.equal(t.full_kv_num_blocks, full_num) and torch.equal(t.full_kv_indices, full_idx)


def test_tiles_of_other_frames_are_full_and_text_between_far_images_is_skipped():
    frames = [(16 + 80 * i, 16 + 80 * i + 63, 0) for i in range(4)]  # 64-token frames, 16 text between
    p = sa.plan(sa.Batch([sa.Seq(320, spans=frames)]), sa.LayerMask())
    t = tile_tables(p, 16, 16)
    # the query block of frame 0's first 16 tokens: every tile of frame 3 is FULL
    full = set(t.full_kv_indices[1, : t.full_kv_num_blocks[1]].tolist())
    assert {16, 17, 18, 19} <= full
    images = [(10, 41, 0), (300, 331, 0)]  # two images, long text between
    p = sa.plan(sa.Batch([sa.Seq(350, spans=images)]), sa.LayerMask())
    t = tile_tables(p, 16, 16)
    visited = set(t.kv_indices[1, : t.kv_num_blocks[1]].tolist()) | set(
        t.full_kv_indices[1, : t.full_kv_num_blocks[1]].tolist()
    )
    assert visited == {0, 1, 2, 18, 19, 20}


@settings(max_examples=40, deadline=None)
@given(types=st.lists(st.sampled_from([0, 0, 1, 2]), min_size=1, max_size=80))
def test_one_block_token_types_are_molmo2s_mask(types):
    """grouping="one_block": every vision token of a row sees every other (transformers' Molmo2
    block ids ``where(types == 1, 0, -1)``), text stays causal; "per_run": each run alone."""
    t = torch.tensor(types)
    vision = t == 1
    causal = torch.ones(len(types), len(types), dtype=torch.bool).tril()
    for grouping, same in (
        ("one_block", vision[:, None] & vision[None, :]),
        (
            "per_run",
            vision[:, None] & vision[None, :] & (run_ids(vision)[:, None] == run_ids(vision)[None, :]),
        ),
    ):
        spans = sa.spans_from_token_types(types, grouping=grouping)
        p = sa.plan(sa.Batch([sa.Seq(len(types), spans=spans)]), sa.LayerMask())
        assert torch.equal(p.to_dense(0), causal | same), grouping
    with pytest.raises(ValueError, match="grouping"):
        sa.spans_from_token_types(types, grouping="per_image")


def run_ids(flags: torch.Tensor) -> torch.Tensor:
    """A distinct id for each maximal run of True."""
    starts = flags & ~torch.nn.functional.pad(flags, (1, 0))[:-1]
    return torch.cumsum(starts.long(), 0)


def test_placeholders_with_an_item_group():
    """A video placeholder whose frames are is_embed runs, and an image in the same group."""
    spans = sa.spans_from_placeholders(
        [(3, 9, [1, 1, 1, 0, 0, 1, 1, 1, 0], "video", 0), (14, 2, None, "image", 0), (18, 2, None, "image")]
    )
    assert spans == [(3, 5, 0), (8, 10, 0), (14, 15, 0), (18, 19)]
    m = sa.plan(sa.Batch([sa.Seq(21, spans=spans)]), sa.LayerMask()).to_dense(0)
    assert m[3, 15] and m[14, 4] and m[18, 19]  # the group across items; the last image alone
    assert not m[3, 18] and not m[15, 18] and not m[6, 8]  # nor into it; text between frames causal


@settings(max_examples=25, deadline=None)
@given(batch=grouped_batches(max_seqs=1, max_len=120), layer=layers(max_window=120))
def test_pictures_count_group_pairs_exactly(batch, layer):
    """viz's per-pixel allowed fractions (intervals plus group keys) equal the dense mask pooled
    the same way; its text drawing is the dense mask."""
    from spanattn import viz

    p = sa.plan(batch, layer)
    q, kv = batch.seqs[0].q_len, batch.seqs[0].kv_len
    dense = p.to_dense(0).double()
    lo, hi, groups = viz._rows(p, 0)
    for r, c in ((1, 1), (2, 3), (7, 5)):
        rows, cols = -(-q // r), -(-kv // c)
        padded = torch.zeros(rows * r, cols * c, dtype=torch.float64)
        padded[:q, :kv] = dense
        n_r = torch.tensor([min(r, q - i * r) for i in range(rows)])
        n_c = torch.tensor([min(c, kv - j * c) for j in range(cols)])
        expect = padded.view(rows, r, cols, c).sum((1, 3)) / (n_r[:, None] * n_c[None]).double()
        assert torch.equal(viz.coverage(lo, hi, kv, r, c, groups), expect)
    if kv <= viz.ASCII_MAX_KEYS:
        drawn = [line.split(" ")[-1] for line in viz.ascii(p).splitlines()[4:]]
        assert drawn == ["".join("#" if x else "." for x in row) for row in p.to_dense(0).tolist()]
