"""Training through ``attn_implementation="spanattn"``: in train mode the loss's gradient reaches
every parameter, equal to transformers' eager attention (fp32, tiny random models of
tests/hf_models.py: left-padded rows with images wider than the sliding window). Where no
backend trains the call, the forward raises instead of training attention that learns nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread  # noqa: E402, F401

TOL = 1e-5
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the triton backend runs on CPU only interpreted
FAMILIES = ["gemma3", "gemma4", "gemma4_unified", "paligemma2", "molmo2"]


def _gradients(model, kw) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    # a label counts the logits one position before it: none of a padding position (whose output
    # transformers' eager attention leaves undefined and spanattn zero) enters the loss
    real = kw["attention_mask"].bool()
    before = torch.nn.functional.pad(real, (1, 0), value=True)[:, :-1]
    labels = kw["input_ids"].masked_fill(~(real & before), -100)
    model(**kw, labels=labels).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "name, backend", [(name, "auto") for name in FAMILIES] + [("gemma3", "triton"), ("gemma4", "triton")]
)
def test_every_parameter_gets_eager_attentions_gradient(name, backend):
    if not hm.available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    if backend == "triton":
        pytest.importorskip("triton")
    eager = hm.build(name).to(DEV)
    ours = sahf.enable(copy.deepcopy(eager), backend=backend)
    kw = {k: v.to(DEV) for k, v in hm.inputs(name).items()}
    want, got = _gradients(eager, kw), _gradients(ours, kw)
    missing = sorted(n for n, g in want.items() if g is not None and got[n] is None)
    assert not missing, f"no gradient through spanattn for {missing}"
    attention = [n for n in want if "self_attn" in n and want[n] is not None]
    assert attention, "the text layers' attention projections are trained"
    # relative to each gradient's own scale, or to a thousandth of the model's largest where the
    # gradient is rounding noise around zero (a key projection's bias: softmax ignores it)
    floor = 1e-3 * max(g.abs().max() for g in want.values() if g is not None)
    scale = lambda g: max(g.abs().max(), floor)
    worst = max(((got[n] - g).abs().max() / scale(g), n) for n, g in want.items() if g is not None)
    assert worst[0] < TOL, worst


def test_a_backend_without_gradients_refuses_in_train_mode(monkeypatch):
    from spanattn.backends import sdpa

    eager = hm.build("gemma3")
    ours = sahf.enable(copy.deepcopy(eager), backend="sdpa")
    monkeypatch.setattr(sdpa, "no_backward", lambda q, plan, **opts: "a test backend without gradients")
    with pytest.raises(RuntimeError, match="backend='sdpa' cannot run this call: a test backend without"):
        _gradients(ours, hm.inputs("gemma3"))
