"""Training through ``attn_implementation="spanattn"``: in train mode each family's objective
(hf_models.loss: next-token loss, PI0's flow matching on its actions, DiffusionGemma's canvas and
encoder losses) gives every parameter transformers' eager attention's gradient (fp32, tiny random
models of tests/hf_models.py: left-padded rows with images wider than the sliding window), also
under gradient checkpointing; bf16 autocast trains. Where no backend trains the call, the forward
raises instead of training attention that learns nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import spanattn
import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread, rel  # noqa: E402, F401

TOL = 1e-5
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the triton backend runs on CPU only interpreted
FAMILIES = list(hm.FAMILIES)


def family(name: str) -> str:
    if not hm.available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return name


@pytest.mark.parametrize(
    "name, backend", [(name, "auto") for name in FAMILIES] + [("gemma3", "triton"), ("gemma4", "triton")]
)
def test_every_parameter_gets_eager_attentions_gradient(name, backend):
    family(name)
    if backend == "triton":
        pytest.importorskip("triton")
    eager = hm.build(name).to(DEV)
    ours = sahf.enable(copy.deepcopy(eager), backend=backend)
    kw = {k: v.to(DEV) for k, v in hm.inputs(name).items()}
    want = hm.gradients(name, eager, kw)
    worst = hm.gradient_error(want, hm.gradients(name, ours, kw))
    assert [n for n in want if "self_attn" in n and want[n] is not None], "text attention is trained"
    assert worst[0] < TOL, worst


def test_pi0_training_forward_runs_spanattn_in_every_text_layer(monkeypatch):
    """PI0's training forward (actions given: the flow-matching loss) runs its VLM prefix and its
    action expert through the attention the config names: spanattn in every layer of both."""
    eager = hm.build(family("pi0"))
    ours = sahf.enable(copy.deepcopy(eager))
    calls = []
    real = spanattn.attention
    spy = lambda *a, **k: calls.append(a[0].requires_grad) or real(*a, **k)
    monkeypatch.setattr(spanattn, "attention", spy)
    hm.gradients("pi0", ours, hm.inputs("pi0"))
    config = ours.config
    layers = config.vlm_config.text_config.num_hidden_layers + config.dit_config.num_hidden_layers
    assert calls == [True] * layers


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", FAMILIES)
def test_gradient_checkpointing(name, reentrant):
    """``model.activation_checkpointing_enable()`` (formerly ``gradient_checkpointing_enable``):
    the layers run again in the backward (the step's plans are reused); every gradient is eager's
    under the same checkpointing. Skipped where transformers' own attention fails under it (PI0:
    its action expert reads the prefix cache that checkpointing turns off; DiffusionGemma,
    reentrant: its decoder's second backward). Gemma 4's reentrant gradients are not its unchecked
    ones, with eager attention too (its KV-shared layers read keys that cross the checkpoint
    outside its inputs): spanattn gives transformers' own."""
    eager = hm.build(family(name))
    kw = hm.inputs(name)
    models = [eager, sahf.enable(copy.deepcopy(eager))]
    for model in models:  # renamed in transformers 5.2x, the old name deprecated
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
        enable({"use_reentrant": reentrant})
    try:
        want = hm.gradients(name, eager, kw)
    except (AttributeError, RuntimeError) as err:
        pytest.skip(f"transformers' eager attention fails under this checkpointing too: {err}"[:200])
    worst = hm.gradient_error(want, hm.gradients(name, models[1], kw))
    assert worst[0] < TOL, worst


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_bf16_autocast_trains(name):
    """Under ``torch.autocast(bfloat16)`` attention runs in bf16; loss and gradients are eager's
    under the same autocast within bf16's rounding (gradients 5% in norm: eager's own bf16
    gradients move 2-3% against SDPA's)."""
    eager = hm.build(family(name))
    ours = sahf.enable(copy.deepcopy(eager))
    kw = hm.inputs(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = hm.gradients(name, eager, kw), hm.gradients(name, ours, kw)
        losses = [hm.loss(name, model.eval(), kw) for model in (eager, ours)]
    assert rel(losses[1], losses[0]) < 1e-2
    flat = lambda grads: torch.cat([g.flatten() for _, g in sorted(grads.items()) if g is not None])
    assert torch.isfinite(flat(got)).all()
    assert ((flat(got) - flat(want)).norm() / flat(want).norm()).item() < 0.05


def test_a_backend_without_gradients_refuses_in_train_mode(monkeypatch):
    from spanattn.backends import sdpa

    ours = sahf.enable(hm.build("gemma3"), backend="sdpa")
    monkeypatch.setattr(sdpa, "no_backward", lambda q, plan, **opts: "a test backend without gradients")
    with pytest.raises(RuntimeError, match="backend='sdpa' cannot run this call: a test backend without"):
        hm.gradients("gemma3", ours, hm.inputs("gemma3"))
