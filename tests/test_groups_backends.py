"""Every backend that runs here on steps with span groups, against the fp64 truth (whose mask
test_groups.py holds to the per-pair predicate): flex eager and compiled on its aligned layout,
triton's prefill kernel (pointer and TMA loads, one and three loops, paged) and its split-KV
decode kernel under TRITON_INTERPRET=1; fa4 and device plans refuse groups by name."""

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
from spanattn.scenarios import group_check_step  # noqa: E402

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
    step = torch.compile(flex._flex_step, dynamic=True)
    q, k, v = inputs(plan, 4, 2, 32, torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = flex.aligned_step(step, q, k, v, plan, 0.2, None, False)
    assert_close_to_truth(out, None, q, k, v, plan, scale=0.2)
