"""spanattn.hf's entry points and rules on tiny random models (tests/hf_models.py): the one-line
``attn_implementation="spanattn"`` with towers left on SDPA, enable/disable, static caches, one
plan per layer kind, the Triton path, and what is refused (inner padding, prepared 4D masks, a
chunk cutting an image, families and configs spanattn does not serve)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import spanattn
import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread, rel  # noqa: E402, F401

TOL = 1e-5


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def models(request):
    """(name, eager fp32, spanattn fp32)."""
    eager = hm.build(request.param)
    return request.param, eager, sahf.enable(copy.deepcopy(eager))


def logits(model, kw):
    with torch.no_grad():
        return model(**kw).logits


@pytest.mark.parametrize("name", ["gemma3", "pi0"])
def test_one_line_entry(name, tmp_path, monkeypatch):
    """``import spanattn.hf`` then ``from_pretrained(..., attn_implementation="spanattn")``: the text
    layers run spanattn, the vision tower transformers' SDPA."""
    eager = hm.build(name)
    eager.save_pretrained(tmp_path)
    cls = type(eager)
    ours = cls.from_pretrained(tmp_path, attn_implementation=sahf.NAME).eval()
    calls = {"spanattn": set(), "sdpa": set()}
    real_attention, real_sdpa = spanattn.attention, sahf.attention._not_ours
    monkeypatch.setattr(
        spanattn, "attention", lambda *a, **k: calls["spanattn"].add(1) or real_attention(*a, **k)
    )
    monkeypatch.setattr(
        sahf.attention,
        "_not_ours",
        lambda m, *a, **k: calls["sdpa"].add(type(m).__name__) or real_sdpa(m, *a, **k),
    )
    kw = hm.inputs(name)
    if name == "pi0":
        assert rel(ours.sample_actions(**kw), eager.sample_actions(**kw)) < TOL
    else:
        real = kw["attention_mask"].bool()
        assert rel(logits(ours, kw)[real], logits(eager, kw)[real]) < TOL
    assert calls == {"spanattn": {1}, "sdpa": {"SiglipAttention"}}


def test_set_attn_implementation():
    eager = hm.build("gemma4")
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(sahf.NAME)
    kw = hm.inputs("gemma4")
    real = kw["attention_mask"].bool()
    assert rel(logits(ours, kw)[real], logits(eager, kw)[real]) < TOL


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_static_cache(name):
    """generate(cache_implementation="static"): the cache hands attention its whole buffer, of
    which only the first tokens are filled; images in the prompt, a left-padded batch."""
    eager = hm.build(name)
    ours = sahf.enable(copy.deepcopy(eager))
    kw = hm.inputs(name)
    opts = dict(
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    a = eager.generate(**kw, cache_implementation="static", **opts)
    b = ours.generate(**kw, cache_implementation="static", **opts)
    assert torch.equal(a.sequences, b.sequences)
    assert max(rel(y, x) for x, y in zip(a.logits, b.logits)) < TOL


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_static_cache_chunked_forward(name):
    """Two prefill chunks into a StaticCache longer than the prompt: the second chunk's queries
    sit inside the buffer, not at its end (at 21 the sliding layers' window has moved)."""
    eager = hm.build(name)
    ours = sahf.enable(copy.deepcopy(eager))
    kw = hm.row(name, hm.inputs(name, pixels=False), 0)
    key, ctx = hm.FAMILIES[name][1], 21
    outs = []
    for model in (eager, ours):
        cache = transformers.StaticCache(config=model.config.get_text_config(), max_cache_len=64)
        first = {"input_ids": kw["input_ids"][:, :ctx], key: kw[key][:, :ctx]}
        rest = {"input_ids": kw["input_ids"][:, ctx:], key: kw[key]}
        with torch.no_grad():
            model(**first, use_cache=True, **{hm.cache_kwarg(model): cache})
            outs.append(model(**rest, use_cache=True, **{hm.cache_kwarg(model): cache}).logits)
    assert rel(outs[1], outs[0]) < TOL
    assert rel(outs[1], logits(ours, kw)[:, ctx:]) < TOL


def test_one_plan_per_layer_kind(models, monkeypatch):
    name, _, ours = models
    calls = []
    real_plan = spanattn.plan
    monkeypatch.setattr(spanattn, "plan", lambda *a, **k: calls.append(a[1]) or real_plan(*a, **k))
    logits(ours, hm.inputs(name, pixels=False))
    assert sorted(map(repr, calls)) == sorted(map(repr, set(calls))) and len(calls) == 2


def test_small_gemma4_is_plain_causal():
    """Gemma 4 without use_bidirectional_attention builds plain causal masks, images or not."""
    eager = hm.build("gemma4")
    eager.config.text_config.use_bidirectional_attention = None
    ours = sahf.enable(copy.deepcopy(eager))
    kw = hm.inputs("gemma4")
    real = kw["attention_mask"].bool()
    assert rel(logits(ours, kw)[real], logits(eager, kw)[real]) < TOL


def test_errors(models):
    name, _, ours = models
    kw = hm.inputs(name, pixels=False)
    kw["attention_mask"][0, 5] = 0  # inner padding (test_hf_padding.py: right padding)
    with pytest.raises(ValueError, match="attention_mask row 0 has padding between real tokens"):
        logits(ours, kw)
    ids = kw["input_ids"][:1]
    prepared = torch.zeros(1, 1, ids.shape[1], ids.shape[1])
    with pytest.raises(TypeError, match="builds its own mask"):
        logits(ours.model.language_model, {"input_ids": ids, "attention_mask": prepared})


def test_enable_twice_then_disable(models):
    name, eager, _ = models
    model = copy.deepcopy(eager)
    sahf.enable(sahf.enable(model), backend="reference")
    text = model.config.get_text_config()
    assert text._attn_implementation == sahf.NAME and sahf.options.options_of(text).backend == "reference"
    assert model.config.vision_config._attn_implementation == "eager"
    kw = hm.inputs(name)
    real = kw["attention_mask"].bool()
    assert rel(logits(model, kw)[real], logits(eager, kw)[real]) < TOL
    sahf.disable(model)
    assert text._attn_implementation == "eager" and sahf.options.options_of(text).backend == "auto"
    assert torch.equal(logits(model, kw), logits(eager, kw))


def test_triton_backend(models):
    """The path a GPU takes (Triton's interpreter on CPU): packed padded rows, a batch-1 strided
    view, decode steps through the split-KV kernel."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    name, eager, _ = models
    model = sahf.enable(copy.deepcopy(eager), backend="triton")
    kw = hm.inputs(name)
    one = hm.row(name, kw, 0)
    assert rel(logits(model, one), logits(eager, one)) < 1e-4
    opts = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(eager.generate(**kw, **opts), model.generate(**kw, **opts))


def test_chunk_cutting_an_image(models):
    """A forward whose keys end inside an image: an error by default; with allow_split_spans the
    image is cut at the chunk end, which is what transformers does."""
    name, eager, ours = models
    key = hm.FAMILIES[name][1]
    kw = hm.row(name, hm.inputs(name, pixels=False), 0)
    kw = {"input_ids": kw["input_ids"][:, :10], key: kw[key]}
    with pytest.raises(ValueError, match="allow_split_spans=True"):
        logits(ours, kw)
    split = sahf.enable(copy.deepcopy(eager), allow_split_spans=True)
    assert rel(logits(split, kw), logits(eager, kw)) < TOL


def test_refused_by_name():
    """enable() refuses, naming them, the configs and families it does not serve."""
    cfg = transformers.Gemma3TextConfig(**hm.TEXT, use_bidirectional_attention=True)
    with pytest.raises(NotImplementedError, match="Gemma 3 model: use_bidirectional_attention=True"):
        sahf.enable(transformers.Gemma3ForCausalLM(cfg))
    # the one-line entry too, though its layers look like an encoder's (bidirectional, no cache)
    cfg = transformers.Gemma4TextConfig(
        **hm.TEXT,
        layer_types=["full_attention"] * 4,
        use_bidirectional_attention="all",
        attn_implementation=sahf.NAME,
    )
    with pytest.raises(NotImplementedError, match="Gemma 4 model: use_bidirectional_attention='all'"):
        logits(transformers.Gemma4ForCausalLM(cfg), {"input_ids": torch.tensor([[1, 2, 3]])})
    # Gemma 3's text model would hand PaliGemma's one mask to both of its layer kinds
    text = dict(hm.TEXT, model_type="gemma3_text")
    pali = transformers.PaliGemmaConfig(
        text_config=text, vision_config=hm.SIGLIP, vocab_size=64, projection_dim=32
    )
    with pytest.raises(NotImplementedError, match="PaliGemma model: text_config is a Gemma3TextConfig"):
        sahf.enable(transformers.PaliGemmaForConditionalGeneration(pali))
    git = transformers.GitConfig(
        vision_config={k: v for k, v in hm.SIGLIP.items() if k != "model_type"},
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=64,
    )
    with pytest.raises(NotImplementedError, match="GitForCausalLM \\(model_type 'git'\\)"):
        sahf.enable(transformers.GitForCausalLM(git))


def test_plain_causal_decoder():
    """A decoder outside the families whose flash-attention path transformers enables."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in hm.TEXT.items()}, attn_implementation="eager")
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(cfg).eval()
    ours = sahf.enable(copy.deepcopy(eager))
    kw = {k: v for k, v in hm.inputs("gemma3", pixels=False).items() if k != "token_type_ids"}
    real = kw["attention_mask"].bool()
    assert rel(logits(ours, kw)[real], logits(eager, kw)[real]) < TOL
