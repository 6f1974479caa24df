"""groups_triton.py (one launch for q_group and k_group, plan()'s default on CUDA) equals
groups.py's torch definition exactly; the tables step_tensors brings from the host equal their
definition; without a GPU the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # set before triton loads (conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import given, settings
from strategies import grouped_batches, layers
from test_intervals_triton import compile_keys
from triton_cpu import DEV, load

import spanattn as sa
from spanattn.groups import span_groups
from spanattn.intervals import step_tensors
from spanattn.scenarios import group_check_step, video_scenarios

groups_triton = load("groups_triton", "_group_ids_kernel")

FIELDS = ("q_group", "k_group", "spans", "extents")


def assert_same(batch: sa.Batch, layer: sa.LayerMask, block: int | None = None):
    """plan()'s groups on CUDA equal the torch definition's; with ``block``, so do the ids of a
    launch with that many rows per program."""
    step = step_tensors(batch, torch.device(DEV))
    want = span_groups(layer, step, batch.total_q, batch.total_k, fused=False)
    got = span_groups(layer, step, batch.total_q, batch.total_k, fused=True)
    if want is None:
        assert got is None
        return
    for name in FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert b.dtype == torch.int32 and torch.equal(a, b), (name, batch, layer)
    assert (want.clamp, want.num_groups) == (got.clamp, got.num_groups)
    if block is not None:
        ids = groups_triton.group_ids_triton(step, batch.total_q, batch.total_k, BLOCK=block)
        assert torch.equal(ids[0], want.q_group) and torch.equal(ids[1], want.k_group), (batch, block)


def table_by_definition(batch: sa.Batch) -> tuple[list, list]:
    """SpanGroups.spans and .extents as the class documents them, from the batch."""
    cu_k = [sum(s.kv_len for s in batch.seqs[:i]) for i in range(len(batch.seqs))]
    rows = [(g, cu_k[i] + a, cu_k[i] + min(b, batch.seqs[i].kv_len - 1)) for i, a, b, g in batch.span_rows]
    rows = sorted(r for r in rows if r[0] >= 0)
    ids = sorted({g for g, *_ in rows})
    assert ids == list(range(len(ids)))
    hull = lambda g: [f([r[i] for r in rows if r[0] == g]) for f, i in ((min, 1), (max, 2))]
    return [list(r) for r in rows], [hull(g) for g in ids]


@settings(max_examples=60, deadline=None)
@given(batch=grouped_batches(), layer=layers())
def test_kernel_equals_torch(batch, layer):
    assert_same(batch, layer)


@settings(max_examples=60, deadline=None)
@given(batch=grouped_batches())
def test_host_tables_equal_their_definition(batch):
    g = sa.plan(batch, sa.LayerMask()).groups
    if g is None:
        assert not batch.has_span_groups
        return
    spans, extents = table_by_definition(batch)
    assert g.spans.dtype == torch.int32 and g.spans.tolist() == spans
    assert g.extents.dtype == torch.int32 and g.extents.tolist() == extents
    # the property's own computation (a copy does not share the host's value) agrees
    assert torch.equal(dataclasses.replace(g).extents, g.extents)
    assert g.num_groups == len(extents)


EDGE_BATCHES = {
    "decode row in a group": sa.Batch(
        [sa.Seq(q_len=1, kv_len=30, spans=[(3, 9, 0), (20, 29, 0)]), sa.Seq(q_len=5, spans=[(0, 1), (3, 4)])]
    ),
    "split group": sa.Batch(
        [sa.Seq(q_len=12, kv_len=12, spans=[(2, 5, 0), (9, 15, 0)], prompt_len=20)], allow_split_spans=True
    ),
    "groups past the chunk": sa.Batch(
        [
            sa.Seq(q_len=5, kv_len=10, spans=[(0, 1, 0), (3, 4, 0), (12, 14, 0)], prompt_len=20),
            sa.Seq(8, spans=[(0, 3, 2), (5, 6, 2)]),
        ]
    ),
    "many seqs": sa.Batch(
        [
            sa.Seq(
                q_len=1 + i % 5, kv_len=3 + 2 * i, causal=i % 3 > 0, spans=[(0, 0, 7), (2, 2, 7)] * (i % 2)
            )
            for i in range(37)
        ]
    ),
    "video": video_scenarios(scale=64)["V1"].batch,
    "check step": group_check_step()[0],
}


@pytest.mark.parametrize("name", EDGE_BATCHES)
@pytest.mark.parametrize("block", [None, 64])  # 64: several query and key programs, short last ones
def test_edge_cases(name, block):
    for layer in (sa.LayerMask(), sa.LayerMask(window=3, spans="clamp")):
        assert_same(EDGE_BATCHES[name], layer, block)


def test_plan_dispatches_to_the_kernel_on_cuda(monkeypatch):
    calls = []
    real = groups_triton.group_ids_triton
    monkeypatch.setattr(groups_triton, "group_ids_triton", lambda *a: calls.append(1) or real(*a))
    p = sa.plan(EDGE_BATCHES["decode row in a group"], sa.LayerMask(), DEV)
    assert p.groups.q_group.tolist() == [0] + [-1] * 5
    assert len(calls) == (DEV == "cuda")


# different lengths, sequence counts (one, two, many) and span counts
STEPS = [EDGE_BATCHES[name] for name in ("split group", "decode row in a group", "many seqs")]


def test_steps_share_one_compiled_kernel():
    """Lengths and counts are runtime values: a new step never compiles a new kernel."""
    kernel = groups_triton._group_ids_kernel
    if DEV == "cuda":  # Triton's own per-device cache of compiled kernels
        sa.plan(STEPS[0], sa.LayerMask(), DEV)
        compiled = kernel.device_caches[torch.cuda.current_device()][0]
        size = len(compiled)
        for batch in STEPS[1:]:
            sa.plan(batch, sa.LayerMask(), DEV)
        assert len(compiled) == size
        return
    launches = []
    for batch in STEPS:
        step = step_tensors(batch, DEV)
        q, k = (torch.empty(n, dtype=torch.int32) for n in (batch.total_q, batch.total_k))
        _, args, constexprs = groups_triton.launch_args(step, batch.total_q, batch.total_k, q, k)
        launches.append((args, constexprs))
    ours, default = compile_keys(kernel, launches)
    assert len(set(ours)) == 1
    assert len(set(default)) > 1  # without do_not_specialize these steps would recompile
