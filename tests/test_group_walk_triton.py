"""The Gluon kernels' span-group tables in one launch each, equal to group_walk.py's torch
definitions exactly: the schedule launch (schedule_triton.py) writes each tile's group walk in
the schedule's order, key_tile_groups_triton.py the key tile groups. Without a GPU the kernels
run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # set before triton loads (conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import grouped_batches, layers
from test_intervals_triton import compile_keys
from triton_cpu import DEV, load

import spanattn as sa
from spanattn.scenarios import group_check_step, video_scenarios

ktg = load("backends.triton.key_tile_groups_triton", "_key_tile_groups_kernel")
schedule_triton = load("backends.triton.schedule_triton", "_tile_info_kernel")
from spanattn.backends import triton as tb  # noqa: E402
from spanattn.backends.triton.group_walk import group_walk, key_tile_groups  # noqa: E402
from spanattn.backends.triton.schedule import build_schedule  # noqa: E402

TILES = [(128, 128), (128, 64), (64, 32), (16, 16)]


def assert_same(plan, bm: int, bn: int, block: int):
    """Both launches equal their definitions on ``plan`` for ``bm x bn`` tiles, LPT and not; the
    key tile groups' launch on its own rows per program and on ``block``."""
    for lpt in (True, False):
        want = build_schedule(plan, bm, bn, lpt)
        got = schedule_triton.build_schedule_triton(plan, bm, bn, lpt)
        assert torch.equal(want.info, got.info) and torch.equal(want.tile_cost, got.tile_cost)
        assert torch.equal(want.walk, got.walk), (plan.batch, plan.layer, bm, bn, lpt)
        assert got.walk.dtype == torch.int32 and torch.equal(want.walk, group_walk(plan, want))
    want = key_tile_groups(plan.groups, bn)
    for rows in (None, block):
        got = ktg.key_tile_groups_triton(plan.groups, bn, rows)
        assert got.dtype == torch.int32 and torch.equal(want, got), (plan.batch, bn, rows)


@settings(max_examples=40, deadline=None)
@given(
    batch=grouped_batches(max_len=300),
    layer=layers(max_window=320),
    tiles=st.sampled_from(TILES),
    block=st.sampled_from([16, 64]),  # key rows per program: several programs, a short last one
)
def test_launches_equal_the_definitions(batch, layer, tiles, block):
    p = sa.plan(batch, layer, DEV)
    if p.groups is None:  # no groups, no walk: the launch writes none
        assert schedule_triton.build_schedule_triton(p, *tiles).walk is None
        assert build_schedule(p, *tiles).walk is None
        return
    assert_same(p, *tiles, block)


STEPS = {
    "video": video_scenarios(scale=64)["V1"].batch,
    "check step": group_check_step(4)[0],
    "frames with text": sa.Batch(
        [sa.Seq(6 * 272, spans=[(16 + 272 * i, 16 + 272 * i + 255, 0) for i in range(6)])]
    ),
}
STEP_LAYERS = [sa.LayerMask(), sa.LayerMask(window=100, spans="clamp"), sa.LayerMask(window=300, spans="on")]


@pytest.mark.parametrize("name", STEPS)
def test_video_steps(name):
    for layer in STEP_LAYERS:
        p = sa.plan(STEPS[name], layer, DEV)
        for bm, bn in TILES[::2]:
            assert_same(p, bm, bn, 64)


def test_group_args_come_from_the_schedule_and_the_plan():
    """The Gluon kernels read the schedule's own walk (its tiles' order: LPT or not) and one key
    tile groups table per key tile size, built once per plan."""
    p = sa.plan(STEPS["frames with text"], sa.LayerMask(), DEV)
    for lpt in (True, False):
        sched = schedule_triton.tile_schedule(p, 128, 64, lpt)
        q_group, k_group, tiles, walk = tb.gluon_group_args(p, sched)
        assert walk is sched.walk and torch.equal(walk.cpu(), group_walk(p, sched).cpu())
        assert tiles is tb.gluon_group_args(p, schedule_triton.tile_schedule(p, 64, 64))[2]
        assert torch.equal(tiles.cpu(), key_tile_groups(p.groups, 64).cpu())
        assert q_group is p.groups.q_group and k_group is p.groups.k_group
    assert tb.gluon_group_args(sa.plan(sa.Batch([sa.Seq(64)]), sa.LayerMask(), DEV), sched) is None


def test_steps_share_one_compiled_kernel():
    """The step's key count is a runtime value: a new step never compiles a new kernel."""
    kernel = ktg._key_tile_groups_kernel
    plans = [sa.plan(STEPS[name], sa.LayerMask(), DEV) for name in STEPS]
    if DEV == "cuda":  # Triton's own per-device cache of compiled kernels
        ktg.key_tile_groups_triton(plans[0].groups, 64)
        compiled = kernel.device_caches[torch.cuda.current_device()][0]
        size = len(compiled)
        for p in plans[1:]:
            ktg.key_tile_groups_triton(p.groups, 64)
        assert len(compiled) == size
        return
    launches = []
    for p in plans:
        _, args, constexprs = ktg.launch_args(p.groups.k_group, 64, torch.empty_like(p.groups.k_group))
        launches.append((args, constexprs))
    ours, default = compile_keys(kernel, launches)
    assert len(set(ours)) == 1
    assert len(set(default)) > 1  # without do_not_specialize these steps would recompile
