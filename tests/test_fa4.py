"""The fa4 backend's lowering, checked without FA4: which path a plan takes, and that the block
tables plus the interval mask_mod (and the span-group one), run the way FA4's block-sparse loop
runs them, give exactly the plan's mask. The kernel itself is checked on the GPU
(benchmarks/gpu_fa4.py, benchmarks/gpu_groups.py)."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import batches, grouped_batches, layers
from test_tiles import packed_dense

import spanattn as sa
from spanattn.backends import fa4, fa4_flags


def interval_mask_mod(kv, lo, width):
    """The kernel's mask_mod in int64: ``kv - lo`` and ``width`` compared as uint32."""
    u32 = lambda x: x.long() & 0xFFFFFFFF
    return u32(kv - lo.long()) <= u32(width)


def group_mask_mod(kv, lo, width, row_group, key_group, clamp: bool):
    """The span-group mask_mod: the interval, or the key's group equal to the row's."""
    same = key_group.long()[kv] == row_group.long()
    if clamp:
        same &= kv >= lo.long()
    return interval_mask_mod(kv, lo, width) | same


def emulate_fa4_mask(plan, head_dim: int) -> torch.Tensor:
    """Boolean ``[total_q, total_k]``: what FA4 computes from the sparse inputs. Per query tile
    it visits the listed PARTIAL tiles with ``mask_mod`` and the FULL tiles without it; every
    other key tile is never loaded. Rows and keys are read back from the aligned layout."""
    t, aux = fa4.sparse_inputs(plan, head_dim)
    layout = fa4.sparse_layout(plan, head_dim)
    bm, bn = t.BLOCK_M, t.BLOCK_N
    assert t.kv_num_blocks.shape[0] * bm == -(-layout.q.num // bm) * bm
    cols = t.kv_indices.shape[1] * bn
    kv = torch.arange(cols)[None, :]
    if plan.groups is None:
        mask_mod = interval_mask_mod(kv, *(a[:, None] for a in aux))
    else:
        lo, width, row_group, key_group = aux
        assert key_group.numel() >= cols  # FA4 reads a key's group for every key of a tile
        mask_mod = group_mask_mod(kv, lo[:, None], width[:, None], row_group[:, None], key_group,
                                  plan.groups.clamp)  # fmt: skip
    got = torch.zeros(t.kv_num_blocks.shape[0] * bm, cols, dtype=torch.bool)
    for m in range(t.kv_num_blocks.shape[0]):
        r = slice(m * bm, (m + 1) * bm)
        for n in t.kv_indices[m, : t.kv_num_blocks[m]].tolist():
            got[r, n * bn : (n + 1) * bn] = mask_mod[r, n * bn : (n + 1) * bn]
        for n in t.full_kv_indices[m, : t.full_kv_num_blocks[m]].tolist():
            got[r, n * bn : (n + 1) * bn] = True
    rows = torch.arange(plan.total_q) if layout.q.rows is None else layout.q.rows
    keys = torch.arange(plan.total_k) if layout.k.rows is None else layout.k.rows
    padding = torch.ones(got.shape[0], dtype=torch.bool)
    padding[rows] = False
    assert not got[padding].any()  # padding rows see nothing
    gap = torch.ones(cols, dtype=torch.bool)
    gap[keys] = False
    assert not got[:, gap].any()  # nor do rows see the zeros between sequences
    return got[rows][:, keys]


@settings(max_examples=40, deadline=None)
@given(batch=batches(), layer=layers(), head_dim=st.sampled_from([64, 128, 192, 256]))
def test_sparse_lowering_is_the_plans_mask(batch, layer, head_dim):
    plan = sa.plan(batch, layer)
    assert torch.equal(emulate_fa4_mask(plan, head_dim), packed_dense(plan))


@settings(max_examples=30, deadline=None)
@given(batch=grouped_batches(), layer=layers(max_window=320), head_dim=st.sampled_from([128, 256]))
def test_span_group_lowering_is_the_plans_mask(batch, layer, head_dim):
    plan = sa.plan(batch, layer)
    assume(plan.groups is not None)
    assert torch.equal(emulate_fa4_mask(plan, head_dim), packed_dense(plan))


def test_each_sequence_gets_its_own_tiles():
    """Decode rows beside a chunk: packed, one tile would hold all 40 decode rows and walk the
    keys of all 40 sequences, and key tiles would straddle sequences; laid out per sequence, no
    tile holds two sequences and no query tile walks more than its own keys."""
    seqs = [sa.Seq(q_len=300, kv_len=900, spans=[(400, 699)])] + [sa.Seq(1, kv_len=1000)] * 40
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(spans="on"))
    layout = fa4.sparse_layout(plan, 128)
    assert layout.q.num == 384 + 40 * 128 and layout.q.rows[:300].tolist() == list(range(300))
    assert layout.q.rows[300:].tolist() == [384 + 128 * i for i in range(40)]
    assert layout.k.rows[900:902].tolist() == [1024, 1025] and layout.k.num == 1024 + 40 * 1024
    t, _ = fa4.sparse_inputs(plan, 128)
    per_tile = t.kv_num_blocks + t.full_kv_num_blocks
    assert int(per_tile.max()) <= 8  # ceil(1000 / 128), never 40 sequences'
    aligned = sa.plan(sa.Batch([sa.Seq(256), sa.Seq(5)]), sa.LayerMask(spans="on"))
    assert not fa4.sparse_layout(aligned, 128).copies  # only the last sequence may end mid-tile


def test_kv_tile_follows_fa4_sm90_tiles():
    # FA4 rejects a sparse key block that is not a multiple of its own key tile
    assert [fa4._kv_tile(d) for d in (64, 128, 160, 192, 256)] == [128, 128, 112, 112, 80]
    assert fa4._kv_tile(256, windowed=True) == 64  # FA4's own local path at d256
    # the built-in path: FA4's causal tiles, and its local ones with a window
    assert [fa4._kv_tile(d, builtin=True) for d in (64, 128, 160, 192, 256)] == [128, 128, 112, 112, 80]
    assert [fa4._kv_tile(d, True, builtin=True) for d in (128, 160, 256)] == [128, 96, 64]
    plan = sa.plan(sa.Batch([sa.Seq(300, spans=[(20, 150)])]), sa.LayerMask(spans="on"))
    t, (lo, width) = fa4.sparse_inputs(plan, 256)
    assert (t.BLOCK_M, t.BLOCK_N) == (128, 80) and lo.shape == width.shape == (512,)
    keys = torch.tensor([0, 1, 299, 2**31 - 2])[None, :]  # padding rows: empty interval
    assert not interval_mask_mod(keys, lo[300:, None], width[300:, None]).any()
    assert fa4.sparse_inputs(plan, 256)[0] is t  # cached on the plan


@pytest.mark.parametrize(
    "seqs, layer, builtin",
    [
        ([sa.Seq(100), sa.Seq(5, kv_len=40)], sa.LayerMask(), True),
        ([sa.Seq(100)], sa.LayerMask(window=16), True),
        ([sa.Seq(100, spans=[(10, 30)])], sa.LayerMask(spans="off"), True),
        ([sa.Seq(100, spans=[(10, 30)])], sa.LayerMask(window=16), False),
        ([sa.Seq(100), sa.Seq(8, causal=False)], sa.LayerMask(), True),
        ([sa.Seq(30, kv_len=90), sa.Seq(8, kv_len=50, causal=False)], sa.LayerMask(window=16), True),
        ([sa.Seq(8, kv_len=50, causal=False)], sa.LayerMask(window=16, noncausal_window="inclusive"), True),
        ([sa.Seq(8, kv_len=50, causal=False, spans=[(45, 49)])], sa.LayerMask(), False),
    ],
)
def test_builtin_path_only_when_the_mask_is_fa4s_own(seqs, layer, builtin):
    plan = sa.plan(sa.Batch(seqs), layer)
    assert fa4.builtin(plan) is builtin
    if builtin:  # FA4's bottom-right mask with each flag's launch's window (left, right)
        for i, s in enumerate(plan.batch.seqs):
            left, right = fa4_flags.window(plan, s.causal)
            left, right = left or 10**9, 0 if s.causal else (right or 10**9)
            q = torch.arange(s.q_len)[:, None] + s.kv_len - s.q_len
            k = torch.arange(s.kv_len)[None, :]
            assert torch.equal(plan.to_dense(i), (k <= q + right) & (k >= q - left))


def test_one_launch_per_flag_the_longer_walks_first():
    step = lambda layer, *seqs: sa.plan(sa.Batch(list(seqs)), layer)
    chunks = [sa.Seq(2048, kv_len=4096)] * 2
    canvases = [sa.Seq(256, kv_len=4096, causal=False)] * 2
    assert fa4_flags.flags(step(sa.LayerMask(), *chunks, *canvases)) == (False, True)  # S4's shape
    short_canvas = step(sa.LayerMask(), *chunks, sa.Seq(256, kv_len=512, causal=False))
    assert fa4_flags.flags(short_canvas) == (True, False)
    # a window bounds both: causal rows see W keys, non-causal 2W - 1
    assert fa4_flags.flags(step(sa.LayerMask(window=64), sa.Seq(64, kv_len=4096), *canvases)) == (False, True)
    assert fa4_flags.flags(step(sa.LayerMask(), *chunks)) == (True,)
    plan = step(sa.LayerMask(), sa.Seq(5), sa.Seq(3, kv_len=9, causal=False), sa.Seq(2))
    assert fa4_flags.used_queries(plan, True).tolist() == [5, 0, 2]
    assert fa4_flags.used_queries(plan, False).tolist() == [0, 3, 0]


def test_auto_passes_decode_and_copying_steps_to_triton():
    q, on = torch.empty(0, 2, 64), sa.LayerMask(spans="on")
    step = lambda layer, *seqs: sa.plan(sa.Batch(list(seqs)), layer)
    decode = step(on, sa.Seq(1, kv_len=900), sa.Seq(4, kv_len=50, causal=False))
    assert "split-KV" in fa4.auto_declines(q, decode)
    ragged = step(on, sa.Seq(300, kv_len=900, spans=[(0, 99)]), sa.Seq(1, kv_len=50))
    assert "copied" in fa4.auto_declines(q, ragged)
    text = step(on, sa.Seq(300, kv_len=900), sa.Seq(20, kv_len=50))  # built-in; 900 keys end mid-tile
    assert "copied" in fa4.auto_declines(q, text)
    whole = step(on, sa.Seq(300, kv_len=1024), sa.Seq(20, kv_len=50))
    assert fa4.auto_declines(q, whole) is None
    video = step(on, sa.Seq(1024, spans=[(16, 271, 0), (288, 543, 0)]))
    assert "span groups" in fa4.auto_declines(q, video)
    aligned = step(on, sa.Seq(256, spans=[(0, 99)]), sa.Seq(300, kv_len=900))
    assert fa4.auto_declines(q, aligned) is None


def test_auto_passes_steps_triton_runs_faster(monkeypatch):
    """Where the Gluon kernels would run the step (as on an H200), auto leaves fa4's sparse path
    to them on sliding layers, above head_dim 128 and on short walks; long d128 global walks
    and every step of FA4's own mask (no span active) stay on fa4."""
    from spanattn.backends import triton as tb

    monkeypatch.setattr(tb, "gluon_runs_for", lambda q, plan, cfg: True)
    q = lambda d: torch.empty(0, 2, d, dtype=torch.bfloat16)
    step = lambda layer, *seqs: sa.plan(sa.Batch(list(seqs)), layer)
    long_prompt, short_prompt = sa.Seq(32768, spans=[(200, 1319)]), sa.Seq(8192, spans=[(200, 1319)])
    global_layer, sliding = sa.LayerMask(spans="on"), sa.LayerMask(window=1024, spans="clamp")
    assert fa4.auto_declines(q(128), step(global_layer, long_prompt)) is None  # walks 16k keys a row
    assert "walking under" in fa4.auto_declines(q(128), step(global_layer, short_prompt))
    assert "head_dim 256" in fa4.auto_declines(q(256), step(global_layer, long_prompt))
    assert "sliding layer" in fa4.auto_declines(q(128), step(sliding, long_prompt))
    for d in (128, 256):  # FA4's own kernels: no span active
        assert fa4.auto_declines(q(d), step(sliding, sa.Seq(8192))) is None
        assert fa4.auto_declines(q(d), step(global_layer, sa.Seq(8192))) is None
    assert fa4.auto_declines(q(64), step(sliding, long_prompt)) is None  # no Gluon kernel at 64
    monkeypatch.setattr(tb, "gluon_runs_for", lambda q, plan, cfg: False)
    assert fa4.auto_declines(q(128), step(sliding, long_prompt)) is None


def test_builtin_keys_start_on_fa4s_key_tiles():
    plan = sa.plan(
        sa.Batch([sa.Seq(30, kv_len=100), sa.Seq(5, kv_len=200), sa.Seq(1, kv_len=7)]), sa.LayerMask()
    )
    rows, cu = fa4._builtin_keys(plan, 256)  # key tiles of 80 at d256
    assert cu.tolist() == [0, 160, 400, 480] and rows.num == 480
    assert rows.rows[99:101].tolist() == [99, 160] and rows.rows[-1].item() == 406
    assert rows.gaps.tolist() == list(range(100, 160)) + list(range(360, 400)) + list(range(407, 480))


def test_named_fa4_never_falls_back():
    plan = sa.plan(sa.Batch([sa.Seq(8)]), sa.LayerMask())
    q = torch.randn(8, 2, 64)
    with pytest.raises(RuntimeError, match="backend='fa4' cannot run this call"):
        sa.attention(q, q[:, :1], q[:, :1], plan, backend="fa4")
