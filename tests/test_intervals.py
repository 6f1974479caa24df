"""The interval form against a brute-force per-pair predicate written here from
docs/design.md section 2, independently of spanattn/intervals.py."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, layers

import spanattn as sa


def allowed(q, k, kv_len, causal, spans, window, mode, noncausal_window):
    """The predicate of docs/design.md section 2, pair by pair."""
    if not 0 <= k < kv_len:
        return False
    past = window is None or q - k < window
    if causal:
        base = k <= q and past
    elif window is None:
        base = True
    elif noncausal_window == "exclusive":
        base = abs(q - k) < window
    else:
        base = abs(q - k) <= window
    span = mode != "off" and any(s <= q <= e and s <= k <= e and (mode != "clamp" or past) for s, e in spans)
    return base or span


def brute_mask(seq, layer):
    ctx = seq.kv_len - seq.q_len
    return torch.tensor(
        [
            [
                allowed(
                    ctx + i,
                    k,
                    seq.kv_len,
                    seq.causal,
                    seq.spans,
                    layer.window,
                    layer.spans,
                    layer.noncausal_window,
                )
                for k in range(seq.kv_len)
            ]
            for i in range(seq.q_len)
        ],
        dtype=torch.bool,
    )


@settings(max_examples=150, deadline=None)
@given(batch=batches(max_len=200), layer=layers(max_window=220))
def test_plan_equals_brute_force(batch, layer):
    p = sa.plan(batch, layer)
    for i, seq in enumerate(batch.seqs):
        assert torch.equal(p.to_dense(i), brute_mask(seq, layer)), (i, seq, layer)


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_len=600), layer=layers())
def test_plan_long_sequences(batch, layer):
    p = sa.plan(batch, layer)
    for i, seq in enumerate(batch.seqs):
        assert torch.equal(p.to_dense(i), brute_mask(seq, layer))


@settings(max_examples=60, deadline=None)
@given(batch=batches(max_len=300), layer=layers(max_window=300))
def test_rows_never_empty_and_hold_the_diagonal(batch, layer):
    p = sa.plan(batch, layer)
    ctx = torch.cat([torch.arange(s.ctx, s.kv_len) for s in batch.seqs]).to(torch.int32)
    assert torch.all(p.lo <= ctx) and torch.all(ctx <= p.hi)
    assert torch.all(p.lo >= 0)
    last = torch.cat([torch.full((s.q_len,), s.kv_len - 1) for s in batch.seqs]).to(torch.int32)
    assert torch.all(p.hi <= last)


def test_image_wider_than_window_in_each_mode():
    seq = sa.Seq(q_len=40, spans=[(5, 24)])
    expect = {  # (lo, hi) of query 20 (inside the 20-token image) with W=4
        "off": (17, 20),
        "on": (5, 24),
        "clamp": (17, 24),
    }
    for mode, (lo, hi) in expect.items():
        p = sa.plan(sa.Batch([seq]), sa.LayerMask(window=4, spans=mode))
        assert (int(p.lo[20]), int(p.hi[20])) == (lo, hi), mode


def test_text_after_image_sees_it_causally_within_window():
    p = sa.plan(sa.Batch([sa.Seq(q_len=40, spans=[(5, 24)])]), sa.LayerMask(window=8, spans="on"))
    assert (int(p.lo[30]), int(p.hi[30])) == (23, 30)


def test_query_offset_is_absolute_and_spans_are_not_rebased():
    # a 10-token chunk at positions 20..29 of a prompt whose image is 15..27
    p = sa.plan(sa.Batch([sa.Seq(q_len=10, kv_len=30, spans=[(15, 27)])]), sa.LayerMask(window=4))
    assert p.lo.tolist() == [15] * 8 + [25, 26]
    assert p.hi.tolist() == [27] * 8 + [28, 29]


def test_decode_row_and_prefix_hit_mid_span():
    p = sa.plan(
        sa.Batch([sa.Seq(q_len=1, kv_len=731), sa.Seq(q_len=5, kv_len=12, spans=[(3, 9)])]),
        sa.LayerMask(window=100),
    )
    assert (int(p.lo[0]), int(p.hi[0])) == (631, 730)
    assert p.lo[1:].tolist() == [0, 0, 0, 0, 0] and p.hi[1:].tolist() == [9, 9, 9, 10, 11]


def test_split_span_capped_when_allowed():
    seq = sa.Seq(q_len=4, kv_len=10, spans=[(6, 12)], prompt_len=20)
    p = sa.plan(sa.Batch([seq], allow_split_spans=True), sa.LayerMask())
    assert p.lo.tolist() == [0, 0, 0, 0] and p.hi.tolist() == [9, 9, 9, 9]


def test_plan_packing():
    b = sa.Batch([sa.Seq(q_len=3, kv_len=5), sa.Seq(q_len=1, kv_len=7), sa.Seq(q_len=2, causal=False)])
    p = sa.plan(b, sa.LayerMask())
    assert p.cu_seqlens_q.tolist() == [0, 3, 4, 6] and p.cu_seqlens_k.tolist() == [0, 5, 12, 14]
    assert p.seq_lens.tolist() == [5, 7, 2] and p.cu_seqlens_q.dtype == torch.int32
    assert p.lo.dtype == torch.int32 and p.hi.dtype == torch.int32
    assert p.allowed_pairs() == (3 + 4 + 5) + 7 + 4
    assert "non-causal" in p.describe() and "num_seqs=3" in repr(p)


def test_step_tensors_start_on_16_bytes_whatever_the_batch_size():
    """Kernels specialize on pointer alignment: offsets moving with the number of sequences
    would compile each kernel twice (seen on the H200: 4 compilations over 100 steps, not 2)."""
    from spanattn.intervals import step_tensors

    for n in range(1, 7):
        b = sa.Batch([sa.Seq(q_len=1 + i, kv_len=9 + i, spans=[(0, 1)] * (i % 2)) for i in range(n)])
        parts = step_tensors(b, torch.device("cpu"))
        assert all(t.data_ptr() % 16 == 0 for t in parts.values())
        assert parts["cu_seqlens_k"].tolist() == [sum(9 + j for j in range(i)) for i in range(n + 1)]
        assert parts["spans"].tolist() == [[i, 0, 1] for i in range(n) if i % 2]
        # with span groups (group ids, the group span table and extents: 1..n rows each)
        grouped = sa.Batch([sa.Seq(q_len=9 + i, spans=[(0, 1, 0), (3, 4 + i % 3, 0)]) for i in range(n)])
        parts = step_tensors(grouped, torch.device("cpu"))
        assert parts["num_groups"] == n and parts["group_extents"].shape == (n, 2)
        assert all(t.data_ptr() % 16 == 0 for t in parts.values() if isinstance(t, torch.Tensor))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    mode=st.sampled_from(["clamp", "on", "off"]),
    causal=st.booleans(),
    noncausal_window=st.sampled_from(["exclusive", "inclusive"]),
)
def test_images_wider_than_the_window(data, mode, causal, noncausal_window):
    """The engines' recurring bug: an image wider than the window. Every example has one."""
    kv_len = data.draw(st.integers(8, 300))
    s = data.draw(st.integers(0, kv_len - 4))
    e = data.draw(st.integers(s + 3, kv_len - 1))
    window = data.draw(st.integers(1, e - s))
    q_len = data.draw(st.integers(max(1, kv_len - e), kv_len))  # some queries inside the image
    seq = sa.Seq(q_len=q_len, kv_len=kv_len, spans=[(s, e)], causal=causal)
    layer = sa.LayerMask(window=window, spans=mode, noncausal_window=noncausal_window)
    assert torch.equal(sa.plan(sa.Batch([seq]), layer).to_dense(0), brute_mask(seq, layer))


def column_dense(qlo, qhi, q_len):
    """Boolean ``[kv_len, q_len]``: key ``k`` seen by queries ``qlo[k]..qhi[k]``."""
    i = torch.arange(q_len)
    return (i[None, :] >= qlo[:, None].long()) & (i[None, :] <= qhi[:, None].long())


@settings(max_examples=150, deadline=None)
@given(batch=batches(max_len=200), layer=layers(max_window=220))
def test_column_intervals_are_the_brute_force_mask_read_by_keys(batch, layer):
    p = sa.plan(batch, layer)
    qlo, qhi = p.columns()
    assert qlo.dtype == qhi.dtype == torch.int32 and qlo.shape == (batch.total_k,)
    k0 = 0
    for seq in batch.seqs:
        keys = slice(k0, k0 + seq.kv_len)
        want = brute_mask(seq, layer).T
        assert torch.equal(column_dense(qlo[keys], qhi[keys], seq.q_len), want), (seq, layer)
        k0 += seq.kv_len


def test_column_intervals_of_an_image_wider_than_the_window():
    # keys 5..24 are an image, window 4: in "on" its keys see the whole image's queries, in
    # "clamp" only those within the window after them; the cached prefix key 1 is seen by no query
    # of the chunk (queries from 10 on) unless the layer has no window
    seq = sa.Seq(q_len=30, kv_len=40, spans=[(5, 24)])
    modes = ("on", "clamp", "off")
    cols = {m: sa.plan(sa.Batch([seq]), sa.LayerMask(window=4, spans=m)).columns() for m in modes}
    ctx = 10
    assert (cols["on"][0][7].item(), cols["on"][1][7].item()) == (0, 24 - ctx)
    assert (cols["clamp"][0][7].item(), cols["clamp"][1][7].item()) == (0, 0)  # 7 + 4 - 1 = 10
    assert (cols["off"][0][12].item(), cols["off"][1][12].item()) == (12 - ctx, 15 - ctx)
    assert cols["off"][0][1] > cols["off"][1][1]
    glo, ghi = sa.plan(sa.Batch([seq]), sa.LayerMask()).columns()
    assert (glo[1].item(), ghi[1].item()) == (0, 29)


@settings(max_examples=60, deadline=None)
@given(batch=batches(max_len=300), layer=layers(max_window=300))
def test_rows_never_decrease_along_a_sequence(batch, layer):
    # the second proof of the column form (intervals.py): lo and hi are monotone per sequence
    p = sa.plan(batch, layer)
    for i in range(p.num_seqs):
        rows = p.seq_slice(i)
        assert torch.all(p.lo[rows].diff() >= 0) and torch.all(p.hi[rows].diff() >= 0)


@settings(max_examples=100, deadline=None)
@given(batch=batches(max_len=200), layer=layers(max_window=220), pad=st.integers(0, 40))
def test_columns_from_rows_are_the_column_intervals(batch, layer, pad):
    # what a device plan derives on the device: the same queries per key, exactly, from lo/hi
    # alone; padding rows (0, -1) and padding keys after the step see and are seen by nothing
    from spanattn.intervals import columns_from_rows

    p = sa.plan(batch, layer)
    lo = torch.cat([p.lo, torch.zeros(pad, dtype=torch.int32)])
    hi = torch.cat([p.hi, torch.full((pad,), -1, dtype=torch.int32)])
    qlo, qhi = columns_from_rows(lo, hi, p.cu_seqlens_q, p.cu_seqlens_k, p.total_k + pad)
    want_lo, want_hi = p.columns()
    seen = want_lo <= want_hi
    assert torch.equal(qlo[: p.total_k] <= qhi[: p.total_k], seen)
    assert torch.equal(qlo[: p.total_k][seen], want_lo[seen])
    assert torch.equal(qhi[: p.total_k][seen], want_hi[seen])
    assert torch.all(qlo[p.total_k :] > qhi[p.total_k :])
