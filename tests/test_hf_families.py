"""Every family spanattn.hf serves, on tiny random models (tests/hf_models.py), against
transformers' own eager attention in fp32: forward logits of a left-padded batch with images
wider than the sliding window (relative error < 1e-5), greedy generate() tokens and per-step
logits, chunked prefill equal to the unchunked forward; DiffusionGemma's encoder prefill, decoder
canvas and generate(); PI0's actions; Molmo2's images and video frames as one span group."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread, rel  # noqa: E402, F401

TOL = 1e-5
LM = [name for name in ("gemma3", "gemma4", "gemma4_unified", "paligemma", "paligemma2", "molmo2")]


def family(name: str):
    if not hm.available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return name


@functools.cache
def pair(name: str):
    """(eager model, the same weights through spanattn) with the default backend ("auto")."""
    eager = hm.build(family(name))
    return eager, sahf.enable(copy.deepcopy(eager))


def logits(model, kw):
    with torch.no_grad():
        return model(**kw).logits


@pytest.mark.parametrize("name", LM)
def test_logits(name):
    eager, ours = pair(name)
    kw = hm.inputs(name)
    real = kw["attention_mask"].bool()  # eager computes noise at padding positions
    theirs = logits(eager, kw)
    assert rel(logits(ours, kw)[real], theirs[real]) < TOL
    # The comparison means something: without token types transformers' logits move far more.
    plain = logits(eager, {k: v for k, v in kw.items() if k != hm.FAMILIES[name][1]})
    assert rel(plain[real], theirs[real]) > 100 * TOL


@pytest.mark.parametrize("name", LM)
def test_generate(name):
    eager, ours = pair(name)
    kw = hm.inputs(name)
    opts = dict(
        max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    a, b = eager.generate(**kw, **opts), ours.generate(**kw, **opts)
    assert torch.equal(a.sequences, b.sequences)
    assert max(rel(y, x) for x, y in zip(a.logits, b.logits)) < TOL


@pytest.mark.parametrize(
    "name,ctx",
    [
        ("gemma3", 3),
        ("gemma3", 21),
        ("gemma4", 21),
        ("gemma4_unified", 21),
        ("paligemma2", 22),
        ("molmo2", 38),  # after its second image: a chunk holding an image must hold the group
    ],
)
def test_chunked_prefill(name, ctx):
    """Row 0 in two chunks, the second after a cached prefix (at 21 the sliding layers' cache has
    dropped keys); token types of the whole prompt with the second chunk (transformers'
    convention). PaliGemma's only chunk end that keeps its prefix whole is the prefix end."""
    eager, ours = pair(name)
    kw = hm.row(name, hm.inputs(name, pixels=False), 0)
    key = hm.FAMILIES[name][1]
    whole = logits(ours, kw)
    chunks = []
    for model in (eager, ours):
        cache = transformers.DynamicCache(config=model.config.get_text_config())
        first = {"input_ids": kw["input_ids"][:, :ctx], key: kw[key][:, :ctx]}
        rest = {"input_ids": kw["input_ids"][:, ctx:], key: kw[key]}
        with torch.no_grad():
            model(**first, use_cache=True, **{hm.cache_kwarg(model): cache})
            chunks.append(model(**rest, use_cache=True, **{hm.cache_kwarg(model): cache}).logits)
    assert rel(chunks[1], whole[:, ctx:]) < TOL
    assert rel(chunks[1], chunks[0]) < TOL


def _diffusion_step(model, kw, canvas):
    """Encoder prefill with the masks generate() builds (its forward alone drops the image
    blocks), then one decoder canvas step; returns the canvas logits."""
    ids, pad = kw["input_ids"], kw["attention_mask"].bool()
    cache = transformers.DynamicCache(config=model.config.get_text_config())
    position_ids = torch.arange(ids.shape[1])[None]
    embeds = torch.empty(*ids.shape, 0)  # positional: the cache argument was renamed in 5.2x
    types = kw.get("mm_token_type_ids")
    masks = model.model.encoder.create_masks_for_generate(
        model.config, embeds, pad, cache, position_ids, types
    )
    images = {k: v for k, v in kw.items() if k in ("pixel_values", "image_position_ids", "mm_token_type_ids")}
    decoder_mask = torch.nn.functional.pad(pad, (0, hm.CANVAS), value=True)
    name = hm.cache_kwarg(model)
    with torch.no_grad():
        model.model.encoder(
            input_ids=ids, attention_mask=masks, position_ids=position_ids, **{name: cache}, **images
        )
        out = model(decoder_input_ids=canvas, decoder_attention_mask=decoder_mask, **{name: cache})
    return out.logits


@pytest.mark.parametrize("padded", [False, True])
def test_diffusion_gemma_encoder_and_canvas(padded):
    """Unpadded, the decoder gets no mask (every key); padded, a bidirectional one over the kept
    prefix and the canvas."""
    eager, ours = pair("diffusion_gemma")
    kw = hm.inputs("diffusion_gemma")
    kw = kw if padded else hm.row("diffusion_gemma", kw, 0)
    canvas = torch.randint(
        0, 64, (kw["input_ids"].shape[0], hm.CANVAS), generator=torch.Generator().manual_seed(3)
    )
    theirs = _diffusion_step(eager, kw, canvas)
    assert rel(_diffusion_step(ours, kw, canvas), theirs) < TOL
    plain = _diffusion_step(eager, {k: v for k, v in kw.items() if k != "mm_token_type_ids"}, canvas)
    assert rel(plain, theirs) > 100 * TOL  # the encoder's image blocks matter


def test_diffusion_gemma_generate():
    """One unpadded row: transformers' eager generate() fails on padded DiffusionGemma batches
    (its decoder mask takes the dtype of the token ids)."""
    eager, ours = pair("diffusion_gemma")
    kw = hm.row("diffusion_gemma", hm.inputs("diffusion_gemma"), 0)
    outs = []
    for model in (eager, ours):
        torch.manual_seed(4)  # canvases start from noise
        outs.append(model.generate(**kw, max_new_tokens=2 * hm.CANVAS).sequences)
    assert torch.equal(*outs)


def test_pi0_actions():
    """The image + language prefix is one bidirectional block, state + actions another: the
    model builds both; its SigLIP tower keeps its own attention."""
    eager, ours = pair("pi0")
    assert ours.config.vlm_config.vision_config._attn_implementation == "eager"
    kw = hm.inputs("pi0")
    actions = eager.sample_actions(**kw)
    assert rel(ours.sample_actions(**kw), actions) < TOL
    step = dict(kw, timestep=torch.full((2,), 0.5))
    assert rel(logits(ours, step), logits(eager, step)) < TOL


MOLMO2_VIDEO = [2, 11] + sum(([30 + i, 31 + i] + [hm.IMG] * 4 for i in range(5)), []) + [12, 13]


@pytest.mark.parametrize("padded, backend", [(False, "auto"), (True, "auto"), (True, "triton")])
def test_molmo2_video_frames(padded, backend):
    """Five 4-token frames with 2 timestamp tokens before each (Molmo2's video layout): every
    frame token sees every frame, the timestamps stay causal; logits and greedy generate(), also
    through the triton kernels (the interpreter on CPU: prefill, then split-KV decode steps)."""
    eager, ours = pair("molmo2")
    if backend == "triton":
        pytest.importorskip("triton")
        if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
            pytest.skip("needs CUDA or TRITON_INTERPRET=1")
        ours = sahf.enable(copy.deepcopy(eager), backend="triton")
    rows = [MOLMO2_VIDEO] + ([[0] * 9 + MOLMO2_VIDEO[:-9]] if padded else [])
    ids = torch.tensor(rows)
    kw = {"input_ids": ids, "attention_mask": (ids != 0).long(), "mm_token_type_ids": (ids == hm.IMG).long()}
    real = kw["attention_mask"].bool()
    theirs = logits(eager, kw)
    assert rel(logits(ours, kw)[real], theirs[real]) < TOL
    # the comparison means something: with the first frame alone a block, transformers' logits move
    first_frame = dict(kw, mm_token_type_ids=kw["mm_token_type_ids"] * (torch.arange(ids.shape[1]) < 10))
    assert rel(logits(eager, first_frame)[real], theirs[real]) > 100 * TOL
    opts = dict(
        max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    a, b = eager.generate(**kw, **opts), ours.generate(**kw, **opts)
    assert torch.equal(a.sequences, b.sequences)
    assert max(rel(y, x) for x, y in zip(a.logits, b.logits)) < TOL


def test_molmo2_chunk_between_images_of_a_group():
    """A prefill chunk that ends between the two images, given the whole prompt's token types:
    its queries of the first image could not see the second, so spanattn raises naming the
    group; with allow_split_spans=True it computes what transformers does (the group capped)."""
    eager, ours = pair("molmo2")
    kw = hm.row("molmo2", hm.inputs("molmo2", pixels=False), 0)
    chunk = {"input_ids": kw["input_ids"][:, :21], "mm_token_type_ids": kw["mm_token_type_ids"]}
    with pytest.raises(ValueError, match="span group 0.*allow_split_spans=True"):
        logits(ours, chunk)
    split = sahf.enable(copy.deepcopy(eager), allow_split_spans=True)
    assert rel(logits(split, chunk), logits(eager, chunk)) < TOL


def test_molmo2_compiled_generation():
    """transformers' compiled generation (a StaticCache, the decode step compiled: it holds no
    span group) after an eager prefill with two images: greedy tokens equal to eager."""
    from test_hf_compiled import GREEDY, NEW, compiled_generate, layers, same_generation

    eager, ours = pair("molmo2")
    kw = hm.inputs("molmo2")
    theirs = eager.generate(**kw, cache_implementation="static", **GREEDY)
    out, calls, _, _ = compiled_generate(copy.deepcopy(ours), kw, compile_forward=False)
    same_generation(theirs, out)
    assert calls == layers(ours) * (NEW - 1)  # every decode step's layers ran spanattn in the graph


def test_molmo2_groups_in_a_compiled_forward_refused_by_name(monkeypatch):
    """Under torch.compile spanattn.hf plans on the device, which plans no span groups: a
    compiled prefill with two images raises naming them (the eager one runs, above)."""
    _, ours = pair("molmo2")
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    kw = hm.row("molmo2", hm.inputs("molmo2", pixels=False), 0)
    cache = transformers.StaticCache(config=ours.config.get_text_config(), max_cache_len=64)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="span groups"):
        ours(**kw, **{hm.cache_kwarg(ours): cache})
