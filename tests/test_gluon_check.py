"""The Gluon kernels' first-use self-check: on CPU its decisions with stand-in runs; on a Hopper
GPU the real check of both forward modules and of the backward passes."""

import warnings

import pytest
import torch

import spanattn.backends.triton as tb
from spanattn.backends.triton import gluon_check


def test_every_variant_passing_enables_the_module():
    seen = []

    def run(d, batch, layer, page, device):
        assert gluon_check.running("kernel_gluon")  # the check itself must reach the kernel
        seen.append((d, layer.spans, page, any(s.groups for s in batch.seqs)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gluon_check.self_check("kernel_gluon", "cpu", run=run)
    assert {x[0] for x in seen} == {128, 256} and {x[2] for x in seen} == {None, 64} and len(seen) == 16
    assert {x[3] for x in seen} == {False, True}  # with and without span groups
    assert not gluon_check.running("kernel_gluon")


def test_the_backward_check_runs_its_steps_without_groups():
    seen = []

    def run(d, batch, layer, page, device):
        assert gluon_check.running(gluon_check.BACKWARD)  # the backward routes to Gluon meanwhile
        shortest = min(s.kv_len for s in batch.seqs)
        seen.append((d, layer.spans, page, any(s.groups for s in batch.seqs), shortest))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gluon_check.self_check(gluon_check.BACKWARD, "cpu", run=run)
    assert {x[0] for x in seen} == {128, 256, 512} and {x[2] for x in seen} == {None} and len(seen) == 12
    assert not any(x[3] for x in seen) and min(x[4] for x in seen) < 64  # a sequence below a dQ key tile
    assert not gluon_check.running(gluon_check.BACKWARD)


@pytest.mark.parametrize("failure", ["wrong", "raise"])
def test_a_failing_variant_warns_once_and_falls_back(failure):
    calls = []

    def run(d, batch, layer, page, device):
        calls.append(d)
        if len(calls) == 2:
            if failure == "raise":
                raise AttributeError("module 'gluon' has no attribute 'warpgroup_mma'")
            return "head_dim 512: err 0.3 (bound 0.01)"

    with pytest.warns(
        RuntimeWarning, match="kernel_gluon_split failed its self-check.*plain Triton kernel"
    ) as w:
        assert not gluon_check.self_check("kernel_gluon_split", "cpu", run=run)
    assert len(w) == 1 and len(calls) == 2  # stops at the first failure
    assert ("warpgroup_mma" if failure == "raise" else "err 0.3") in str(w[0].message)
    assert not gluon_check.running("kernel_gluon_split")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("name", ["kernel_gluon", "kernel_gluon_split", gluon_check.BACKWARD])
def test_the_real_check_passes_on_hopper(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert gluon_check.self_check(name, torch.device("cuda"), tb)


def test_the_gluon_backward_runs_only_when_checked_or_asked(monkeypatch):
    """gluon_backward_runs' decisions on a stand-in Hopper plan: never with span groups, fp32, a
    head_dim it is not built for or ``SPANATTN_TRITON_GLUON=0``; with ``=1`` always; by default
    only once ``GLUON_BACKWARD_CHECKED`` (on a checked triton at once, on another after the
    self-check, whose verdict it takes); ``=check`` runs the self-check whatever the flag."""
    from types import SimpleNamespace

    monkeypatch.setattr(tb, "_capability", lambda device: (9, 0))
    plan = SimpleNamespace(groups=None, device=torch.device("cuda", 0))
    asked = []
    monkeypatch.setattr(gluon_check, "passes", lambda name, index, backend: asked.append(name) or verdict[0])
    verdict = [True]

    def runs(setting="", checked=False, triton_checked=True, d=128, dtype=torch.bfloat16, groups=None):
        monkeypatch.setenv(tb.GLUON_ENV, setting)
        monkeypatch.setattr(tb, "GLUON_BACKWARD_CHECKED", checked)
        parts = tb._gluon_module("gluon_parts")
        monkeypatch.setattr(parts, "checked_triton", lambda: triton_checked)
        return tb.gluon_backward_runs(SimpleNamespace(**{**vars(plan), "groups": groups}), d, dtype)

    assert not runs() and not runs(triton_checked=False) and not asked  # not yet checked on a GPU
    assert runs("1") and runs("1", d=512) and not runs("1", d=64) and not runs("1", dtype=torch.float32)
    assert not runs("1", groups=object()) and not runs("0", checked=True)
    assert runs(checked=True) and not asked  # a checked triton: no self-check
    assert runs(checked=True, triton_checked=False) and asked == [gluon_check.BACKWARD]
    verdict[0] = False
    assert not runs(checked=True, triton_checked=False) and not runs("check")
    assert asked == [gluon_check.BACKWARD] * 3
