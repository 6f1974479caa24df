"""The triton backend's Gluon kernel (kernel_gluon.py: sm_90 only, no interpreter) against fp64
truth with NaN-poisoned outputs; elsewhere, only that it is never chosen."""

from dataclasses import replace

import pytest
import torch
from tolerance import assert_close_to_truth

import spanattn as sa

pytest.importorskip("triton")
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not SM90, reason="the Gluon kernel runs on sm_90 only")

# Every sequence at least one 128-key tile long (the kernel reads K/V by TMA): a chunk with
# spans on and across tile edges, a decode row, a non-causal canvas, a ragged causal sequence.
LONG = sa.Batch(
    [
        sa.Seq(q_len=300, kv_len=700, spans=[(128, 255), (500, 640)]),
        sa.Seq(q_len=1, kv_len=333),
        sa.Seq(q_len=200, kv_len=200, causal=False),
        sa.Seq(q_len=130, kv_len=130, spans=[(3, 70)]),
    ]
)
LAYERS = {
    "causal": sa.LayerMask(spans="off"),
    "on": sa.LayerMask(spans="on"),
    "W1": sa.LayerMask(window=1),
    "W37-clamp": sa.LayerMask(window=37, spans="clamp"),
    "W200-on-inclusive": sa.LayerMask(window=200, spans="on", noncausal_window="inclusive"),
}


def test_chosen_only_for_hopper_tma_steps(monkeypatch):
    from spanattn.backends.triton import uses_gluon
    from spanattn.backends.triton.configs import Config

    cfg = Config(128, 128, 8, 3, tma=True, gluon=True)
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert not uses_gluon(q, cfg, tma=True)  # not on a GPU
    if SM90:
        q = q.cuda()
        assert uses_gluon(q, cfg, tma=True)
        assert not uses_gluon(q, cfg, tma=False)
        assert not uses_gluon(q, replace(cfg, gluon=False), tma=True)
        assert not uses_gluon(q.float(), cfg, tma=True)
        assert not uses_gluon(q[..., :64].contiguous(), cfg, tma=True)  # head_dim 64
        assert uses_gluon(torch.cat([q, q], -1), cfg, tma=True)  # head_dim 256
        assert not uses_gluon(q, replace(cfg, block_m=64), tma=True)
        monkeypatch.setenv("SPANATTN_TRITON_GLUON", "0")
        assert not uses_gluon(q, cfg, tma=True)
        heads_apart = torch.zeros(4, 4, 128, dtype=torch.bfloat16, device="cuda")[:, ::2]
        assert not uses_gluon(heads_apart, cfg, tma=True)


def _qkv(p, hq, hkv, dtype, seed=0, d=128):
    g = torch.Generator().manual_seed(seed)
    shapes = ((p.total_q, hq), (p.total_k, hkv), (p.total_k, hkv))
    return (torch.randn(n, h, d, generator=g).to(dtype) for n, h in shapes)


@hopper_only
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("layer", list(LAYERS.values()), ids=list(LAYERS))
@pytest.mark.parametrize(
    "dtype, hq, hkv, softcap",
    [(torch.bfloat16, 8, 4, None), (torch.float16, 16, 2, None), (torch.bfloat16, 8, 8, 30.0)],
    ids=["bf16-gqa2", "fp16-gqa8", "bf16-mha-softcap"],
)
def test_matches_truth(layer, dtype, hq, hkv, softcap, d):
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import pick

    p = sa.plan(LONG, layer, device="cuda")
    q, k, v = (t.cuda() for t in _qkv(p, hq, hkv, dtype, d=d))
    cfg = pick(d, dtype, False, layer.window)
    assert tb.uses_gluon(q, cfg, tb.uses_tma(p, k, v, cfg))
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, softcap=softcap, return_lse=True, out=out)
    opts = {"softcap": softcap} if softcap else {}
    truth_plan = sa.plan(LONG, layer)
    assert_close_to_truth(out.cpu(), lse.cpu(), q.cpu(), k.cpu(), v.cpu(), truth_plan, scale=d**-0.5, **opts)


@hopper_only
@pytest.mark.parametrize("d", [128, 256])
def test_sequences_never_read_each_others_keys(d):
    """The middle sequence's neighbours hold inf keys and NaN values; its output and LSE must be
    exact (its last tile is read shifted back, never into the next sequence)."""
    from spanattn.backends import triton as tb

    seqs = [sa.Seq(q_len=5, kv_len=200), sa.Seq(q_len=150, kv_len=300), sa.Seq(q_len=5, kv_len=200)]
    p = sa.plan(sa.Batch(seqs), sa.LayerMask(spans="off"), device="cuda")
    q, k, v = _qkv(p, 4, 2, torch.float32, seed=3, d=d)
    for rows in (slice(0, 200), slice(500, None)):
        k[rows], v[rows] = float("inf"), float("nan")
    q, k, v = (t.half().cuda() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    out, lse = tb.forward(q, k, v, p, scale=d**-0.5, return_lse=True, out=out)
    middle = sa.plan(sa.Batch(seqs[1:2]), sa.LayerMask(spans="off"))
    qc, kc, vc = (t[r].cpu() for t, r in ((q, slice(5, 155)), (k, slice(200, 500)), (v, slice(200, 500))))
    assert_close_to_truth(out[5:155].cpu(), lse[5:155].cpu(), qc, kc, vc, middle, scale=d**-0.5)
