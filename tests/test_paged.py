"""Paged attention and the split-KV decode kernel against fp64 truth on K/V gathered from the pages.

Every cache slot that no sequence owns (other blocks, the tail of each last page) holds NaN, and
outputs are poisoned with NaN before the kernel runs: a read outside a sequence's keys or a row
left unwritten shows up as NaN. The Triton kernel runs under TRITON_INTERPRET=1 without a GPU.
"""

import pytest
import torch
from tolerance import assert_close_to_truth

import spanattn as sa
from spanattn.cache import gather_kv, slot_mapping

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def paged_step(batch, layer, hq, hkv, d, block_size, dtype, seed=0, width=None, num_blocks=None):
    """A plan, q, and NaN-filled caches holding each sequence's keys in shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    p = sa.plan(batch, layer, device=DEV)
    need = [-(-s.kv_len // block_size) for s in batch.seqs]
    width = width or max(need) + 1  # spare columns: must never be read
    num_blocks = num_blocks or sum(need) + 3
    ids = torch.randperm(num_blocks, generator=g)
    bt = torch.empty(len(need), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        bt[i, :n] = ids[used : used + n]
        bt[i, n:] = ids[-1]  # an unowned block, all NaN
        used += n
    bt = bt.to(DEV)
    kc = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    # write every key through the cache writer: a "prefill" plan whose new tokens are all keys
    full = sa.plan(sa.Batch([sa.Seq(q_len=s.kv_len) for s in batch.seqs]), sa.LayerMask(), device=DEV)
    k = torch.randn(p.total_k, hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(p.total_k, hkv, d, generator=g).to(dtype).to(DEV)
    sa.write_kv_cache(k, v, kc, vc, slot_mapping(full, bt, block_size))
    q = torch.randn(p.total_q, hq, d, generator=g).to(dtype).to(DEV)
    return p, q, k, v, kc, vc, bt


DECODE = sa.Batch(
    [
        sa.Seq(q_len=1, kv_len=97),  # last page partly filled
        sa.Seq(q_len=4, kv_len=64, spans=[(40, 62)]),  # speculative block inside an image
        sa.Seq(q_len=1, kv_len=1),
        sa.Seq(q_len=3, kv_len=50, causal=False),  # a diffusion canvas
    ]
)


@pytest.mark.parametrize(
    "block_size, dtype, layer, hq, hkv, split_keys, softcap",
    [
        (16, torch.float16, sa.LayerMask(spans="on"), 4, 2, 10**9, None),
        (32, torch.float16, sa.LayerMask(window=24, spans="clamp"), 4, 1, 32, None),
        (16, torch.float32, sa.LayerMask(window=40, spans="on"), 2, 2, None, 3.0),
    ],
)
def test_decode_kernel_paged(block_size, dtype, layer, hq, hkv, split_keys, softcap):
    from spanattn.backends.triton.decode import decode_forward

    p, q, k, v, kc, vc, bt = paged_step(DECODE, layer, hq, hkv, 32, block_size, dtype)
    out = torch.full_like(q, float("nan"))
    if dtype == torch.float32:  # the cache viewed flat, as the triton backend passes it
        kc, vc, page = kc.flatten(0, 1), vc.flatten(0, 1), block_size
    else:
        page = None
    out, lse = decode_forward(
        q, kc, vc, p, scale=0.2, softcap=softcap, return_lse=True, block_table=bt, page_size=page,
        split_keys=split_keys, out=out,
    )  # fmt: skip
    opts = {"softcap": softcap} if softcap else {}
    assert_close_to_truth(out.cpu(), lse.cpu(), *(t.cpu() for t in (q, k, v)), _cpu(p), scale=0.2, **opts)


def test_decode_kernel_packed_kv():
    from spanattn.backends.triton.decode import decode_forward

    p, q, k, v, *_ = paged_step(DECODE, sa.LayerMask(window=30, spans="on"), 4, 2, 24, 16, torch.float16)
    out, lse = decode_forward(q, k, v, p, scale=0.3, return_lse=True, split_keys=16)
    assert_close_to_truth(out.cpu(), lse.cpu(), *(t.cpu() for t in (q, k, v)), _cpu(p), scale=0.3)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dense_backends_paged_equal_packed(backend):
    p, q, k, v, kc, vc, bt = paged_step(
        DECODE, sa.LayerMask(window=20, spans="clamp"), 4, 2, 16, 16, torch.float32
    )
    paged = sa.attention(q, kc, vc, p, block_table=bt, backend=backend, return_lse=True)
    packed = sa.attention(q, k, v, p, backend=backend, return_lse=True)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    kg, vg = gather_kv(kc, vc, bt, p)
    assert torch.equal(kg, k) and torch.equal(vg, v)


MIXED = sa.Batch(
    [
        sa.Seq(q_len=20, kv_len=70, spans=[(55, 69)]),
        sa.Seq(q_len=1, kv_len=40),
        sa.Seq(q_len=8, kv_len=8, causal=False),
    ]
)


@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_backend_paged(batch):
    """The public path: prefill chunks with an image, decode rows and a canvas in one paged call
    (the prefill kernel's paged mode), and a decode-shaped step (routed to the split-KV kernel)."""
    p, q, k, v, kc, vc, bt = paged_step(
        batch, sa.LayerMask(window=16, spans="clamp"), 2, 1, 16, 16, torch.float16
    )
    from spanattn import backends

    if "triton" not in backends.BACKENDS:
        pytest.skip("the triton backend is not registered")
    out, lse = sa.attention(q, kc, vc, p, block_table=bt, backend="triton", return_lse=True)
    assert_close_to_truth(out.cpu(), lse.cpu(), *(t.cpu() for t in (q, k, v)), _cpu(p))


PREFILL = sa.Batch(
    [
        sa.Seq(q_len=40, kv_len=150, spans=[(100, 139)]),  # a chunk; last page partly filled
        sa.Seq(q_len=1, kv_len=77),  # a decode row
        sa.Seq(q_len=24, kv_len=24, causal=False),  # a canvas inside one page
        sa.Seq(q_len=16, kv_len=128),  # fills its pages exactly: the table has no spare column
    ]
)


def _cfg(block_n, one_loop=False):
    from spanattn.backends.triton.configs import Config

    return Config(16, block_n, 4, 1, one_loop=one_loop)


@pytest.mark.parametrize(
    "page, config, layer, dtype",
    [
        (16, None, sa.LayerMask(spans="on"), torch.float16),
        (32, None, sa.LayerMask(window=40, spans="clamp"), torch.float16),
        (64, None, sa.LayerMask(window=24, spans="on"), torch.float32),
        (64, _cfg(32, one_loop=True), sa.LayerMask(window=40, spans="clamp"), torch.float16),
        (16, _cfg(32), sa.LayerMask(window=40, spans="on"), torch.float16),
        (16, _cfg(64, one_loop=True), sa.LayerMask(spans="clamp"), torch.float32),
    ],
    ids=["p16-n16", "p32-n16", "p64-n16", "p64-n32-one-loop", "p16-n32", "p16-n64-one-loop"],
)
def test_prefill_kernel_paged_tiles(page, config, layer, dtype):
    """The prefill kernel's two ways of reading pages: one block_table entry per KV tile when
    BLOCK_N divides the page (the interpreter's BLOCK_N is 16), one per key row when pages are
    smaller than the tile. NaN in every slot no sequence owns (the tails of last pages included)
    and a block_table exactly as wide as the longest sequence needs; the output must be bit-equal
    to packed K/V under the same config and within the tolerance rule of fp64 truth."""
    from spanattn.backends import triton as tb

    width = max(-(-s.kv_len // page) for s in PREFILL.seqs)
    p, q, k, v, kc, vc, bt = paged_step(PREFILL, layer, 2, 1, 16, page, dtype, width=width)
    run = lambda k, v, **kw: tb.forward(
        q, k, v, p, scale=0.25, return_lse=True, out=torch.full_like(q, float("nan")),
        config=config, kernel="prefill", **kw,
    )  # fmt: skip
    paged, packed = run(kc, vc, block_table=bt), run(k, v)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    assert_close_to_truth(paged[0].cpu(), paged[1].cpu(), *(t.cpu() for t in (q, k, v)), _cpu(p), scale=0.25)


def test_prefill_copies_small_pages_out_on_long_walks(monkeypatch):
    """A step whose keys are each seen by many queries copies its pages into packed K/V first
    (threshold lowered here to reach that path at test size): bit-equal to packed K/V."""
    from spanattn.backends import triton as tb

    monkeypatch.setattr(tb, "GATHER_PAIRS_PER_KEY", 0)
    p, q, k, v, kc, vc, bt = paged_step(PREFILL, sa.LayerMask(spans="on"), 2, 1, 16, 16, torch.float16)
    assert tb.gathers_pages(p, 16, 32)
    run = lambda k, v, **kw: tb.forward(
        q, k, v, p, scale=0.25, return_lse=True, config=_cfg(32), kernel="prefill", **kw
    )
    paged, packed = run(kc, vc, block_table=bt), run(k, v)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    again = run(kc, vc, block_table=bt)  # the plan's copy buffers are reused, overwritten
    assert torch.equal(again[0], packed[0])


@pytest.mark.parametrize(
    "page, hkv, d, dtype, max_block_w, head_strided",
    [
        (16, 1, 16, torch.float16, None, False),
        (32, 2, 32, torch.float32, None, False),
        (64, 3, 16, torch.float16, None, False),  # a row of 48 elements: a masked 64-wide tile
        (16, 3, 16, torch.float32, 32, False),  # two column tiles, the second half masked
        (32, 2, 16, torch.float16, None, True),  # heads 2*D apart: rows not contiguous
    ],
    ids=["p16-h1-d16", "p32-h2-d32-fp32", "p64-h3-d16", "p16-h3-d16-col-tiles", "p32-head-strided"],
)
def test_page_copy_kernel_equals_gather(monkeypatch, page, hkv, d, dtype, max_block_w, head_strided):
    """The one-launch page copy against gather_kv, bit for bit: shuffled pages, last pages partly
    filled, NaN in every slot no sequence owns and in the outputs before the copy."""
    from spanattn.backends.triton import page_copy

    if max_block_w:
        monkeypatch.setattr(page_copy, "MAX_BLOCK_W", max_block_w)
    p, _, k, v, kc, vc, bt = paged_step(PREFILL, sa.LayerMask(), 1, hkv, d, page, dtype)
    if head_strided:  # each head's D elements, then D of padding
        kc, vc = (torch.cat([t, torch.full_like(t, float("nan"))], -1)[..., :d] for t in (kc, vc))
    out_k, out_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    page_copy.copy_pages(p, kc.flatten(0, 1), vc.flatten(0, 1), bt, page, out_k, out_v)
    kg, vg = gather_kv(kc, vc, bt, p)
    assert torch.equal(out_k, kg) and torch.equal(out_v, vg)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


def test_which_steps_copy_pages_out():
    """At page 16, 128-key tiles and GQA 2: the global layer (S2, ~16k pairs per key) and the
    sliding one (S1, 1k per key) copy, the chunked layer (S3, ~0.4k) walks its pages at d256
    (twice the bytes per key of d128); over 128-token pages (whole tiles) the threshold doubles:
    S1 copies at d128 only, S3 walks."""
    from spanattn.backends import triton as tb
    from spanattn.scenarios import scenarios

    sc = scenarios()
    plans = {i: sa.plan(sc[i].batch, sc[i].layer) for i in ("S0", "S1", "S2", "S3")}
    for d in (128, 256):
        got = {i: tb.gathers_pages(p, 16, 128, 2, d) for i, p in plans.items()}
        assert got == {"S0": True, "S1": True, "S2": True, "S3": d == 128}
    for d in (128, 256):
        got = {i: tb.gathers_pages(p, 128, 128, 2, d) for i, p in plans.items()}
        assert got == {"S0": True, "S1": d == 128, "S2": True, "S3": False}


def test_pages_are_copied_out_for_the_gluon_kernels():
    """Where a Gluon kernel would read the copy (sm_90, bf16, sequences long enough), a paged
    prefill step copies its pages even where ``gathers_pages`` would walk them (S3 over 128-token
    pages); elsewhere that rule decides."""
    from spanattn.backends import triton as tb
    from spanattn.scenarios import scenarios

    sc = scenarios()["S3"]
    p = sa.plan(sc.batch, sc.layer, device=DEV)
    q = torch.empty(p.total_q, 16, 256, dtype=torch.bfloat16, device=DEV)
    assert not tb.gathers_pages(p, 128, 64, 2, 256)
    assert tb.copies_pages(q, p, 128, 64, 8) == tb.gluon_runs_on(q.device)
    assert not tb.copies_pages(q, p, 128, 64, 8, may_use_gluon=False)
    assert not tb.copies_pages(q.float(), p, 128, 64, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_new_steps():
    from spanattn.backends.triton.decode import decode_forward

    def step(seed):
        b = sa.Batch([sa.Seq(q_len=1, kv_len=300 + 97 * seed), sa.Seq(q_len=1, kv_len=1000 - 50 * seed)])
        return paged_step(b, sa.LayerMask(), 8, 2, 64, 16, torch.float16, seed=seed, width=70, num_blocks=150)

    p0, q0, _, _, kc0, vc0, bt0 = step(0)
    static = dict(
        q=q0.clone(), kc=kc0.clone(), vc=vc0.clone(), bt=bt0.clone(), lo=p0.lo.clone(), hi=p0.hi.clone()
    )
    p0.lo, p0.hi, p0.seq_lens = static["lo"], static["hi"], p0.seq_lens.clone()
    run = lambda: decode_forward(
        static["q"], static["kc"], static["vc"], p0, scale=0.125, block_table=static["bt"]
    )
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run()
    for seed in (1, 2):
        p, q, k, v, kc, vc, bt = step(seed)
        for name, new in (("q", q), ("kc", kc), ("vc", vc), ("bt", bt), ("lo", p.lo), ("hi", p.hi)):
            static[name].copy_(new)
        p0.seq_lens.copy_(p.seq_lens)
        graph.replay()
        want = sa.attention(q, kc, vc, p, block_table=bt, backend="reference")
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


def _cpu(p):
    return p if p.device.type == "cpu" else sa.plan(p.batch, p.layer)
