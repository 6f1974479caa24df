"""Every backend that runs here on steps with span groups, against the fp64 truth (whose mask
test_groups.py holds to the per-pair predicate): flex eager and compiled on its aligned layout,
triton's prefill kernel (pointer and TMA loads, one and three loops, paged) and its split-KV
decode kernel under TRITON_INTERPRET=1; fa4 where FA4 runs (its lowering's mask is checked without
FA4 in test_fa4.py); device plans refuse groups by name."""

import importlib
import os
import shutil
import warnings

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings  # noqa: E402
from strategies import grouped_batches, layers  # noqa: E402
from tolerance import assert_close_to_truth  # noqa: E402

import spanattn as sa  # noqa: E402
from spanattn.backends import flex  # noqa: E402
from spanattn.scenarios import group_check_step, group_decode_step  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS = list(group_check_step()[1])


def inputs(plan, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((plan.total_q, hq), (plan.total_k, hkv), (plan.total_k, hkv))
    return [torch.randn(n, h, d, generator=g).to(dtype).to(plan.device) for n, h in shapes]


def check(plan, q, k, v, out, lse, scale):
    cpu = plan if plan.device.type == "cpu" else sa.plan(plan.batch, plan.layer)
    args = (x.cpu() for x in (out, lse, q, k, v))
    assert_close_to_truth(*args, cpu, scale=scale, rounding_slack=True)


@settings(max_examples=12, deadline=None)
@given(batch=grouped_batches(max_len=200), layer=layers(max_window=200))
def test_flex_eager_random(batch, layer):
    plan = sa.plan(batch, layer)
    q, k, v = inputs(plan, 4, 2, 16, torch.float32)
    check(plan, q, k, v, *flex.forward(q, k, v, plan, scale=0.3, return_lse=True), 0.3)


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs a C++ compiler")
@pytest.mark.parametrize("layer", LAYERS)
def test_flex_compiled_aligned_tables(layer):
    """Compiled flex skips blocks by the tables: wrong group tiles or a wrong aligned layout of
    the group ids would show (positions x4: groups across 128-row tiles, sequences copied)."""
    batch, layers_ = group_check_step(4)
    plan = sa.plan(batch, layers_[layer])
    assert flex.aligned_layout(plan, flex.BLOCK_M, flex.BLOCK_N).copies
    step = torch.compile(flex._flex_group_step, dynamic=True)
    q, k, v = inputs(plan, 4, 2, 32, torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = flex.aligned_step(step, q, k, v, plan, 0.2, None, False)
    assert_close_to_truth(out, None, q, k, v, plan, scale=0.2)


def _triton(name):
    pytest.importorskip("triton")
    module = importlib.import_module(f"spanattn.backends.triton.{name}")
    interpreted = module.INTERPRETED
    if DEV == "cpu" and not interpreted:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_INTERPRET is not set and there is no GPU")
        importlib.reload(module)
    return module


def run_triton(plan, hq=4, hkv=2, d=32, dtype=torch.float16, **kw):
    from spanattn.backends import triton as tb

    q, k, v = inputs(plan, hq, hkv, d, dtype)
    out = torch.full_like(q, float("nan"))  # an unwritten row fails
    out, lse = tb.forward(q, k, v, plan, scale=d**-0.5, return_lse=True, out=out, **kw)
    check(plan, q, k, v, out, lse, d**-0.5)


@pytest.mark.parametrize("layer", LAYERS)
def test_triton_prefill(layer):
    _triton("kernel")
    batch, layers_ = group_check_step()
    run_triton(sa.plan(batch, layers_[layer], DEV), kernel="prefill")


# every sequence at least one 32-key tile long, none a multiple of it: TMA can run
LONG = sa.Batch(group_check_step()[0].seqs[:3])


@pytest.mark.parametrize(
    "one_loop, dv_split, tma, layer",
    [(True, 1, False, "on"), (False, 2, False, "W24_clamp"), (False, 1, True, "on"),
     (True, 1, True, "W24_clamp"), (True, 2, True, "W9_on")],
    ids=["one-loop", "dv-split", "tma", "tma-one-loop", "tma-dv-split"],
)  # fmt: skip
def test_triton_prefill_variants(one_loop, dv_split, tma, layer):
    """Both KV-walk variants, split output columns and TMA loads (the tile across a sequence end
    read shifted back), key tiles wider than query tiles."""
    _triton("kernel")
    from spanattn.backends.triton import uses_tma
    from spanattn.backends.triton.configs import Config

    cfg = Config(16, 32, 4, 1, one_loop=one_loop, dv_split=dv_split, tma=tma)
    plan = sa.plan(LONG if tma else group_check_step()[0], group_check_step()[1][layer], DEV)
    kv = torch.empty(plan.total_k, 2, 32, dtype=torch.float16, device=DEV)
    assert uses_tma(plan, kv, kv, cfg) == tma
    run_triton(plan, config=cfg)


@pytest.mark.parametrize("page, block_n", [(16, 16), (8, 32), (64, 32)])
def test_triton_prefill_paged_equals_packed(page, block_n):
    """Pages read in place (a page entry per tile or per key row), NaN in every slot no sequence
    owns: bit-equal to packed K/V."""
    _triton("kernel")
    from spanattn.backends import triton as tb
    from spanattn.backends.triton.configs import Config
    from spanattn.cache import to_paged

    batch, layers_ = group_check_step()
    plan = sa.plan(batch, layers_["W24_clamp"], DEV)
    q, k, v = inputs(plan, 4, 2, 32, torch.float16)
    kc, vc, bt = to_paged(k, v, plan, page, fill=float("nan"))
    cfg = Config(16, block_n, 4, 1)
    run = lambda k, v, **kw: tb.forward(q, k, v, plan, scale=0.2, return_lse=True, config=cfg, **kw)
    paged, packed = run(kc, vc, block_table=bt), run(k, v)
    assert torch.equal(paged[0], packed[0]) and torch.equal(paged[1], packed[1])
    check(plan, q, k, v, *paged, 0.2)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("paged", [False, True])
def test_triton_decode(layer, paged):
    """The split-KV kernel on decode-shaped rows inside groups: speculative blocks in frames of
    a video (one seeing the next frame), a decode row after a group, a canvas, split across
    programs."""
    decode = _triton("decode")
    from spanattn.cache import to_paged

    batch = group_decode_step()
    plan = sa.plan(batch, group_check_step()[1][layer], DEV)
    q, k, v = inputs(plan, 4, 2, 32, torch.float16)
    assert decode.suited(plan, 2)
    opts = {}
    if paged:
        k, v, opts["block_table"] = to_paged(k, v, plan, 16, fill=float("nan"))
    out, lse = decode.decode_forward(q, k, v, plan, scale=0.2, return_lse=True, split_keys=32, **opts)
    check(plan, *inputs(plan, 4, 2, 32, torch.float16), out, lse, 0.2)


@settings(max_examples=10, deadline=None)
@given(batch=grouped_batches(max_len=120), layer=layers(max_window=130))
def test_triton_random(batch, layer):
    _triton("kernel")
    _triton("decode")
    run_triton(sa.plan(batch, layer, DEV), hq=2, hkv=1, d=16)


@settings(max_examples=8, deadline=None)
@given(batch=grouped_batches(max_seqs=3, max_len=90), layer=layers(max_window=60))
def test_schedule_cost_spans_every_allowed_key(batch, layer):
    """LPT orders tiles by the keys they walk: with groups, each tile's cost is the hull of its
    rows' allowed keys read off the dense mask; the one-launch builder equals the definition."""
    _triton("kernel")
    from spanattn.backends.triton.columns import INFO
    from spanattn.backends.triton.schedule import build_schedule
    from spanattn.backends.triton.schedule_triton import build_schedule_triton

    p = sa.plan(batch, layer, DEV)
    a, b = build_schedule(p, 16, 32), build_schedule_triton(p, 16, 32)
    assert torch.equal(a.info, b.info) and torch.equal(a.tile_cost, b.tile_cost)
    cpu = sa.plan(batch, layer)
    rows = [row for i in range(cpu.num_seqs) for row in cpu.to_dense(i)]  # packed query order
    for info, cost in zip(a.info.tolist(), a.tile_cost.tolist()):
        t = dict(zip(INFO, info))
        keys = torch.stack(rows[t["q_row0"] : t["q_row_last"] + 1]).any(0).nonzero()
        assert cost == int(keys.max() - keys.min() + 1)


@pytest.mark.parametrize("layer", LAYERS)
def test_fa4(layer):
    """The sparse path with the span-group mask_mod, on the check step at positions x8."""
    from spanattn.backends import fa4

    batch, layers_ = group_check_step(8)
    plan = sa.plan(batch, layers_[layer], DEV)
    q, k, v = inputs(plan, 4, 2, 128, torch.bfloat16)
    if fa4.unavailable(q, plan):
        pytest.skip(fa4.unavailable(q, plan))
    out, lse = sa.attention(q, k, v, plan, backend="fa4", return_lse=True)
    check(plan, q, k, v, out, lse, 128**-0.5)


def test_device_plans_refuse_groups_by_name():
    planner = sa.DevicePlanner({"g": sa.LayerMask()}, max_seqs=2, max_tokens=16, max_kv_len=16, max_spans=2)
    with pytest.raises(ValueError, match="span groups are planned on the host"):
        planner.update(torch.tensor([8]), torch.tensor([8]), spans=torch.tensor([[0, 1, 2, 0], [0, 4, 5, 0]]))
