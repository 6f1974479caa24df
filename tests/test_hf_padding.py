"""Right padding through ``attn_implementation="spanattn"``: rows ``1..1 0..0`` (what training
collators give, labels -100 on the padding) and ``0..0 1..1 0..0`` in a forward without cache
history. Logits and every parameter's gradient equal to transformers' eager attention (fp32, tiny
random models of tests/hf_models.py); padded keys never seen, padded queries' outputs zero. Refused,
naming the rule: padding between real tokens (also a canvas or actions after a right-padded
prompt), and right padding where a cache is read or filled (decoding after it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread, rel  # noqa: E402, F401

TOL = 1e-5
LM = ["gemma3", "gemma4", "gemma4_unified", "paligemma", "paligemma2", "molmo2"]


pair = hm.eager_and_spanattn


def logits(model, kw):
    model.eval()
    with torch.no_grad():
        return model(**kw).logits


@pytest.mark.parametrize("keep_left", [0, 1], ids=["right", "both_sides"])
@pytest.mark.parametrize("name", LM)
def test_right_padding_trains_like_eager(name, keep_left):
    eager, ours = pair(name)
    kw = hm.right_padded(name, hm.inputs(name), keep_left)
    real = kw["attention_mask"].bool()
    assert not real[1, -1] and real[1, keep_left] and real[1, :keep_left].sum() == 0
    assert rel(logits(ours, kw)[real], logits(eager, kw)[real]) < TOL
    worst = hm.gradient_error(hm.gradients(name, eager, kw), hm.gradients(name, ours, kw))
    assert worst[0] < TOL, worst


def test_padded_queries_are_zero_and_padded_keys_unseen():
    """Each layer's attention output (o_proj's input) is exactly zero on padding rows, and a real
    row's logits do not move when the padded tokens change."""
    _, ours = pair("gemma3")
    kw = hm.right_padded("gemma3", hm.inputs("gemma3"), keep_left=1)
    pad = ~kw["attention_mask"].bool()
    outputs = []
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: outputs.append(args[0]))
        for layer in ours.model.language_model.layers
    ]
    try:
        before = logits(ours, kw)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(outputs) == len(ours.model.language_model.layers)
    assert all(torch.isfinite(o).all() and o[pad].abs().max() == 0 for o in outputs)
    other = dict(kw, input_ids=kw["input_ids"].masked_fill(pad, 33))
    assert torch.equal(logits(ours, other)[~pad], before[~pad])


@pytest.mark.parametrize("name", ["diffusion_gemma", "pi0"])
def test_tokens_after_a_right_padded_prompt_refused(name):
    """DiffusionGemma's canvas and PI0's actions follow the prompt: a right-padded prompt leaves
    padding between real tokens, which spanattn refuses (left-pad these prompts)."""
    _, ours = pair(name)
    kw = hm.right_padded(name, hm.inputs(name))
    with pytest.raises(ValueError, match="attention_mask row 1 has padding between real tokens"):
        hm.gradients(name, ours, kw)


def test_decoding_after_right_padding_refused():
    """The prefill runs (no cache history), its decode step would read the padding: refused. A
    StaticCache refuses at the prefill (its compiled decode steps could not), and so does a chunk
    after cached tokens."""
    _, ours = pair("gemma3")
    kw = hm.right_padded("gemma3", hm.inputs("gemma3", pixels=False))
    ours.eval()
    with pytest.raises(ValueError, match="padding between real tokens.*after a right-padded prompt"):
        ours.generate(**kw, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="row 1 is right-padded .* in a step that reads or fills a cache"):
        ours.generate(**kw, max_new_tokens=2, do_sample=False, cache_implementation="static")
    cache = transformers.DynamicCache(config=ours.config.get_text_config())
    first = {k: v[:, :10] for k, v in kw.items()}
    rest = dict(kw, input_ids=kw["input_ids"][:, 10:])
    with torch.no_grad():
        ours(**first, use_cache=True, **{hm.cache_kwarg(ours): cache})
        with pytest.raises(ValueError, match="row 1 is right-padded"):
            ours(**rest, use_cache=True, **{hm.cache_kwarg(ours): cache})
