"""What a CUDA graph capture refuses, caught on CPU: a device-planned step (DevicePlanner.update,
the slot mapping, the cache write and attention of two layer kinds on the triton kernels) may
neither read a device value on the host (``aten._local_scalar_dense``: a sync) nor make a tensor
from Python data (``aten.lift_fresh``: ``torch.tensor(...)`` or ``x[i] = 1``, a copy from pageable
host memory). Both run fine eagerly, so on a GPU only the capture would fail; recording the ops
the step dispatches tells on any machine. (The triton kernels run under TRITON_INTERPRET=1; the
checks that read values on the host skip themselves while a capture runs.) A host plan of a step
with span groups (``sa.plan``) copies its description once and then never waits for the device
either: no sync and no ``nonzero`` (whose output size the host must read)."""

import collections

import pytest
import torch
from test_device_planner import DECODE, DEV, LAYER, MIXED, inputs, planner_for
from test_paged import paged_step
from torch.utils._python_dispatch import TorchDispatchMode

import spanattn as sa
from spanattn import groups, intervals
from spanattn.scenarios import group_check_step

REFUSED = ("aten._local_scalar_dense", "aten.lift_fresh")


class Record(TorchDispatchMode):
    """Counts every aten op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func).rsplit(".", 1)[0]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch, max_q_len", [(MIXED, None), (DECODE, 4)], ids=["prefill", "decode"])
def test_a_device_planned_step_neither_syncs_nor_copies_from_the_host(batch, max_q_len):
    pytest.importorskip("triton")
    layers = {"sliding": LAYER, "global": sa.LayerMask(spans="on")}
    _, q, k, v, k_cache, v_cache, bt = paged_step(batch, LAYER, 4, 2, 16, 16, torch.float16, width=5)
    planner = planner_for(batch, layers, max_q_len=max_q_len, max_kv_len=80)
    planner.prepare("triton", head_dim=16, dtype=torch.float16, group=2)
    pad = lambda t, n: torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])
    cap = planner.capacity
    q, bt = pad(q, cap.max_tokens), pad(bt, cap.max_seqs)
    k_new, v_new = (pad(x[: batch.total_q], cap.max_tokens) for x in (k, v))
    step = inputs(batch)  # the engine's metadata, already on the device
    planner.update(*step)  # as before a capture: the first step may allocate
    with Record() as record:
        plans = planner.update(*step)
        for plan in plans.values():
            # check_slots reads the slots (a sync): skipped by default while capturing
            sa.write_kv_cache(k_new, v_new, k_cache, v_cache, plan.slot_mapping(bt, 16), check_slots=False)
            sa.attention(q, k_cache, v_cache, plan, block_table=bt, backend="triton")
    assert record.ops["aten.empty_strided"] + record.ops["aten.empty"] > 0  # it did record the step
    assert {op: record.ops[op] for op in REFUSED} == dict.fromkeys(REFUSED, 0)


SYNCS = ("aten._local_scalar_dense", "aten.nonzero")  # a value read on the host; a size read there


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
def test_planning_a_grouped_step_never_syncs(fused, monkeypatch):
    """``sa.plan`` of a step with span groups waits for the device nowhere, with the Triton
    launches it takes on CUDA (``fused``; on CPU in the interpreter) or the torch definitions."""
    if fused:
        pytest.importorskip("triton")
    for module in (intervals, groups):
        monkeypatch.setattr(module, "fuses", lambda step: fused)
    batch, layers = group_check_step()
    with Record() as record:
        plans = [sa.plan(batch, layer, DEV) for layer in layers.values()]
    assert all(p.groups is not None for p in plans)
    assert record.ops["aten.empty_strided"] + record.ops["aten.empty"] + record.ops["aten.arange"] > 0
    assert {op: record.ops[op] for op in SYNCS} == dict.fromkeys(SYNCS, 0)


@pytest.mark.parametrize("prepared", [False, True], ids=["built-per-layer", "prepared"])
def test_a_device_planned_training_step_neither_syncs_nor_copies_from_the_host(prepared):
    # the op's autograd around its backward (copies of the plan) and, since the ops are opaque to
    # a dispatch mode, the backward op's implementation called as the op calls it: column
    # intervals and key tiles built on the device (or prepared by the planner's update)
    pytest.importorskip("triton")
    from spanattn.grad import _device_backward

    layers = {"sliding": LAYER, "global": sa.LayerMask(spans="on")}
    planner = planner_for(MIXED, layers, slack=3)
    if prepared:
        planner.prepare("triton", head_dim=16, dtype=torch.float16, group=2, backward=True)
    cap = planner.capacity
    g = torch.Generator().manual_seed(0)
    make = lambda n, h: torch.randn(n, h, 16, generator=g).to(DEV, torch.float16).requires_grad_()
    q, k, v = make(cap.max_tokens, 4), make(cap.max_kv_tokens, 2), make(cap.max_kv_tokens, 2)
    step = inputs(MIXED)
    planner.update(*step)
    for plan in planner.plans.values():  # as before a capture: the first step compiles and allocates
        sa.attention(q, k, v, plan, backend="triton").sum().backward()
    with Record() as record:
        plans = planner.update(*step)
        for plan in plans.values():
            out, lse = sa.attention(q, k, v, plan, backend="triton", return_lse=True)
            (out.float().sum() + lse.sum()).backward()
            tensors = (plan.lo, plan.hi, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.seq_lens, plan.op_tables)
            _device_backward(torch.ones_like(out), None, q.detach(), k.detach(), v.detach(), out.detach(),
                             lse.detach(), *tensors, plan.op_meta, "triton", None, None)  # fmt: skip
    assert record.ops["spanattn.attention_backward_device_plan"] == 2 and record.ops["aten.clone"] > 0
    assert record.ops["aten.searchsorted"] > 0  # it did record the backward's planning
    assert {op: record.ops[op] for op in REFUSED} == dict.fromkeys(REFUSED, 0)
