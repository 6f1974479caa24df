"""The flex backend on CPU against the fp64 reference, by the rule of docs/design.md section 4:
``err(flex vs fp64) <= 2 * err(same-dtype reference vs fp64) + 1e-4``, NaN never passes.

flex allocates its own output, so there is nothing to poison; a NaN or an unwritten row shows
up as an error against the fp64 truth instead."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import batches, layers
from tolerance import assert_close_to_truth

import spanattn as sa
from spanattn.backends import flex
from spanattn.oracle import Truth, max_err

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def inputs(plan, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, h, d, generator=g).to(dtype)
        for n, h in ((plan.total_q, hq), (plan.total_k, hkv), (plan.total_k, hkv))
    ]


def check(plan, q, k, v, run, scale=0.2, softcap=None, lse=True):
    out, lse_f = run(q, k, v, plan, scale=scale, softcap=softcap, return_lse=lse)
    assert out.shape == q.shape and out.dtype == q.dtype
    if lse:
        assert lse_f.shape == (plan.total_q, q.shape[1]) and lse_f.dtype == torch.float32
    assert_close_to_truth(out, lse_f, q, k, v, plan, scale=scale, softcap=softcap, rounding_slack=True)


@settings(max_examples=12, deadline=None)
@given(
    batch=batches(max_seqs=3, max_len=300),
    layer=layers(max_window=300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    heads=st.sampled_from([(2, 2), (4, 1), (4, 2)]),
)
def test_random_layouts(batch, layer, dtype, heads):
    plan = sa.plan(batch, layer)
    check(plan, *inputs(plan, *heads, 32, dtype), flex.forward)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_softcap(softcap, dtype):
    batch = sa.Batch(
        [
            sa.Seq(q_len=300, kv_len=700, spans=[(100, 250), (410, 611)]),  # chunk after an image
            sa.Seq(q_len=1, kv_len=129),  # decode row
            sa.Seq(200, causal=False),  # diffusion canvas
        ]
    )
    plan = sa.plan(batch, sa.LayerMask(window=96, spans="clamp"))
    check(plan, *inputs(plan, 4, 2, 64, dtype), flex.forward, softcap=softcap)


def test_through_attention_api():
    plan = sa.plan(sa.Batch([sa.Seq(130, spans=[(3, 80)]), sa.Seq(7)]), sa.LayerMask(window=16))
    q, k, v = inputs(plan, 2, 1, 16, torch.float32)
    out, lse = sa.attention(q, k, v, plan, backend="flex", return_lse=True)
    truth = Truth(q, k, v, plan)
    assert max_err(out, truth.out) < 1e-5 and max_err(lse, truth.lse) < 1e-5


def test_unavailable_reasons():
    plan = sa.plan(sa.Batch([sa.Seq(4)]), sa.LayerMask())
    assert flex.unavailable(torch.zeros(4, 2, 64), plan) is None
    assert "power-of-two" in flex.unavailable(torch.zeros(4, 2, 48), plan)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_cpu_uses_the_tables():
    """Compiled flex (CPU) skips blocks by the tables, so wrong tables or a wrong aligned layout
    would show; and a new step of other lengths reuses the compiled graph (dynamic shapes)."""
    from torch._dynamo.utils import counters

    step = torch.compile(flex._flex_step, dynamic=True)
    graphs = None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (700, 1040):
            batch = sa.Batch(
                [sa.Seq(q_len=300, kv_len=n, spans=[(410, 611)]), sa.Seq(5), sa.Seq(140, causal=False)]
            )
            plan = sa.plan(batch, sa.LayerMask(window=100, spans="clamp"))
            flex.prepare(plan)

            def run(q, k, v, plan, scale, softcap, return_lse):
                return flex.aligned_step(step, q, k, v, plan, scale, softcap, False)

            check(plan, *inputs(plan, 4, 2, 64, torch.float32), run, lse=False)
            if graphs is None:
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs, "a new step recompiled"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled CUDA path needs a GPU")
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_compiled_lse_softcap(softcap):
    """The compiled path (LSE through AuxRequest, softcap as score_mod) on a step whose query
    blocks straddle many sequences: decode rows, a chunk after an image, a canvas."""
    seqs = [sa.Seq(q_len=1, kv_len=300 + 97 * i) for i in range(40)]
    seqs += [sa.Seq(q_len=700, kv_len=2100, spans=[(1300, 1800)]), sa.Seq(256, causal=False)]
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(window=512, spans="clamp"), "cuda")
    q, k, v = (x.cuda() for x in inputs(plan, 8, 2, 128, torch.bfloat16))
    check(plan, q, k, v, flex.forward, scale=128**-0.5, softcap=softcap)


def test_compiled_step_never_runs_eagerly_past_the_recompile_limit():
    # past dynamo's limit a compiled step would run flex's eager math (a neighbour's NaN in every
    # row's gradient): an error naming the backend instead
    step = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    for n in range(1, flex.RECOMPILE_LIMIT + 1):
        assert flex.run_compiled(step, torch.ones(n)).sum() == 2 * n
    with pytest.raises(RuntimeError, match="flex backend: torch.compile could not build .*LimitHit"):
        flex.run_compiled(step, torch.ones(flex.RECOMPILE_LIMIT + 1))
