"""The triton backend decides what a call runs once per call shape and keeps it on the plan
(backends/triton/__init__.py ``call_shape``, ``_route``; direct_launch.py): later calls of that
shape must give what a fresh plan gives, bit for bit, a call of another shape (dtype, 16-byte
alignment, layout, flags) must get its own route, and the kept routes must not keep the plan
alive. Under TRITON_INTERPRET=1 when there is no GPU."""

import gc
import importlib
import os
import weakref

import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import spanattn as sa  # noqa: E402

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
D = 128 if DEV == "cuda" else 32  # the GPU runs the Gluon kernels at 128
BATCH = sa.Batch([sa.Seq(q_len=40, kv_len=70, spans=[(50, 66)]), sa.Seq(q_len=24, causal=False)])
DECODE = sa.Batch([sa.Seq(q_len=1, kv_len=37), sa.Seq(q_len=2, kv_len=90)])
LAYER = sa.LayerMask(window=24, spans="clamp")
# Big enough on the GPU for the Gluon kernels (sequences of at least a key tile).
GPU_BATCH = sa.Batch([sa.Seq(q_len=300, kv_len=700, spans=[(500, 660)]), sa.Seq(q_len=256, causal=False)])


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from spanattn.backends.triton import decode, kernel

    if DEV == "cpu" and not kernel.INTERPRETED:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_INTERPRET is not set and there is no GPU")
        importlib.reload(kernel)
        importlib.reload(decode)


def tensors(p, seed, d=D, hq=4, hkv=2, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(p.total_q, hq, d, generator=g).to(dtype).to(DEV)
    k, v = (torch.randn(p.total_k, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    return q, k, v


def call(p, q, k, v, **kw):
    from spanattn.backends import triton as tb

    return tb.forward(q, k, v, p, scale=0.2, return_lse=True, **kw)


def routes(p) -> int:
    return sum(1 for key in p._facts if isinstance(key, tuple) and key[0] == "triton.call")


@pytest.mark.parametrize("batch", [BATCH if DEV == "cpu" else GPU_BATCH, DECODE], ids=["prefill", "decode"])
def test_new_tensors_of_one_shape_reuse_the_route(batch):
    p = sa.plan(batch, LAYER, device=DEV)
    for seed in range(3):
        q, k, v = tensors(p, seed)
        out, lse = call(p, q, k, v, softcap=5.0 if seed == 2 else None)
        fresh = call(sa.plan(batch, LAYER, device=DEV), q, k, v, softcap=5.0 if seed == 2 else None)
        assert torch.equal(out, fresh[0]) and torch.equal(lse, fresh[1])
    assert routes(p) == 2  # without a softcap and with one


def test_other_call_shapes_take_their_own_route():
    p = sa.plan(BATCH, LAYER, device=DEV)
    q, k, v = tensors(p, 0)
    call(p, q, k, v)
    # q one element past a 16-byte boundary: Triton specializes pointers on alignment.
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)
    shifted = buf[1:].view_as(q).copy_(q)
    assert shifted.data_ptr() % 16
    strided = torch.empty(*q.shape, 2, dtype=q.dtype, device=DEV)[..., 0].copy_(q)  # copied per call
    for q2 in (shifted, strided):
        out, lse = call(p, q2, k, v)
        fresh = call(sa.plan(BATCH, LAYER, device=DEV), q, k, v)
        assert torch.equal(out, fresh[0]) and torch.equal(lse, fresh[1])
    assert routes(p) == 2  # the strided q was routed per call, not kept
    q3, k3, v3 = (t.float() for t in (q, k, v))
    out, _ = call(p, q3, k3, v3)
    assert out.dtype == torch.float32 and routes(p) == 3


def test_paged_calls_reuse_the_route():
    p = sa.plan(DECODE, sa.LayerMask(), device=DEV)
    page = 16
    q, k, v = tensors(p, 0)
    need = [-(-s.kv_len // page) for s in DECODE.seqs]
    kc, vc = (torch.zeros(sum(need) + 1, page, 2, D, dtype=DTYPE, device=DEV) for _ in range(2))
    bt = torch.zeros(len(need), max(need), dtype=torch.int32)
    first, cu_k = 1, p.cu_seqlens_k.tolist()
    for i, s in enumerate(DECODE.seqs):
        bt[i, : need[i]] = torch.arange(first, first + need[i])
        for pos in range(s.kv_len):
            kc[bt[i, pos // page], pos % page] = k[cu_k[i] + pos]
            vc[bt[i, pos // page], pos % page] = v[cu_k[i] + pos]
        first += need[i]
    bt = bt.to(DEV)
    packed = call(p, q, k, v)
    for _ in range(2):
        out, lse = call(p, q, kc, vc, block_table=bt)
        torch.testing.assert_close(out, packed[0], atol=2e-3, rtol=0)
    assert routes(p) == 2
    wide = call(p, q, kc, vc, block_table=bt.long())  # int64 table: its own route, same result
    assert torch.equal(wide[0], out) and routes(p) == 3


def test_kept_routes_do_not_keep_the_plan_alive():
    p = sa.plan(BATCH, LAYER, device=DEV)
    q, k, v = tensors(p, 0)
    call(p, q, k, v)
    call(p, q, k, v, kernel="prefill")
    assert routes(p) == 2
    ref = weakref.ref(p)
    gc.disable()  # freed by reference counts alone: no cycle through the kept routes
    try:
        del p
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.skipif(DEV != "cuda", reason="compiled kernels need a GPU")
def test_direct_launch_equals_triton_and_respects_launch_hooks():
    from spanattn.backends.triton import decode
    from spanattn.backends.triton.direct_launch import knobs

    p = sa.plan(DECODE, sa.LayerMask(), device=DEV)
    q, k, v = tensors(p, 0)
    launch = decode.DecodeLaunch(q, k, v, p, softcap=False, return_lse=True)
    first = launch(q, k, v, 0.2)  # through Triton, keeps the compiled kernels
    assert launch.decode.compiled
    again = launch(q, k, v, 0.2)  # direct
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    seen = []
    knobs.runtime.launch_enter_hook = lambda meta: seen.append(meta)
    try:
        hooked = launch(q, k, v, 0.2)
    finally:
        knobs.runtime.launch_enter_hook = None
    assert seen and torch.equal(hooked[0], first[0])
