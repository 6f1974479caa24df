"""spanattn.hf on tiny random Gemma 3 / Gemma 4 vision models (nothing downloaded): logits equal
transformers' eager attention within the tolerance rule (DESIGN.md section 4), greedy
``generate()`` gives the same tokens, with left padding, a KV cache, images wider than the
sliding window (W=8, 16 tokens per image) and text after images."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch

import spanattn
import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")

IMG, PAD, W = 5, 0, 8
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=W,
    layer_types=LAYERS,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def build(name: str, bidir="vision"):
    torch.manual_seed(0)
    if name == "gemma3":
        vision = dict(VISION, image_size=16, patch_size=4)
        cfg = transformers.Gemma3Config(
            text_config=TEXT, vision_config=vision, mm_tokens_per_image=16, image_token_id=IMG
        )
    else:
        text = dict(TEXT, global_head_dim=32, use_bidirectional_attention=bidir, num_kv_shared_layers=2)
        text.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=64)
        vision = dict(VISION, num_key_value_heads=1, patch_size=4, pooling_kernel_size=2)
        ids = dict(image_token_id=IMG, boi_token_id=6, eoi_token_id=7, video_token_id=8, audio_token_id=9)
        cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, **ids)
    cfg._attn_implementation = "eager"
    cls = (
        transformers.Gemma3ForConditionalGeneration
        if name == "gemma3"
        else transformers.Gemma4ForConditionalGeneration
    )
    return cls(cfg).eval()


IMAGES_PER_ROW = (2, 1)


def inputs(name: str) -> dict:
    """Two left-padded rows: row 0 has two images and text between/after them, row 1 one image.
    Positions count real tokens only, as generate() does."""
    torch.manual_seed(1)
    img = [IMG] * 16
    rows = [[2, 9, 10] + img + [11, 12] + img + [13, 14, 15], [PAD] * 20 + [2, 20] + img + [21, 22]]
    ids = torch.tensor(rows)
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [20]])).long()
    out = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0)}
    types = (ids == IMG).long()
    if name == "gemma3":
        out.update(token_type_ids=types, pixel_values=torch.randn(3, 3, 16, 16))
    else:
        xy = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).reshape(
            1, 64, 2
        )
        out.update(mm_token_type_ids=types, pixel_values=torch.randn(3, 64, 48))
        out["image_position_ids"] = xy.repeat(3, 1, 1)
    return out


def row(kw: dict, b: int) -> dict:
    """Row ``b`` alone and unpadded, its images only."""
    first = sum(IMAGES_PER_ROW[:b])
    images = slice(first, first + IMAGES_PER_ROW[b])
    real = kw["attention_mask"][b].bool()
    out = {k: v[b : b + 1, real] for k, v in kw.items() if v.dim() == 2}
    out.update({k: v[images] for k, v in kw.items() if k in ("pixel_values", "image_position_ids")})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with other jobs on the CPU, a second spinning thread costs 10-20x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def models(request):
    """(name, eager fp32, eager fp64 truth, spanattn fp32)."""
    eager = build(request.param)
    # sdpa: "auto" would pick the Triton interpreter here (TRITON_INTERPRET=1 on CPU), 80x slower
    ours = sahf.enable(copy.deepcopy(eager), backend="sdpa")
    return request.param, eager, copy.deepcopy(eager).double(), ours


def logits(model, kw):
    with torch.no_grad():
        return model(**kw).logits.double()


def test_logits_match_eager(models):
    name, eager, truth_model, ours = models
    kw = inputs(name)
    # The truth runs each row unpadded: eager attention in fp64 turns fully masked padding rows
    # into NaN (its softmax runs in fp32, where fp64's most negative bias is -inf).
    double = lambda d: {k: v.double() if v.is_floating_point() else v for k, v in d.items()}
    real = kw["attention_mask"].bool()  # padding rows are not compared (eager outputs noise there)
    truth = torch.cat([logits(truth_model, double(row(kw, b)))[0] for b in range(2)])
    err_ref = (logits(eager, kw)[real] - truth).abs().max().item()
    err = (logits(ours, kw)[real] - truth).abs().max().item()
    assert err <= 2 * err_ref + 1e-4, (err, err_ref)
    # The comparison means something: without spans the logits move far more than that.
    no_spans = {k: v for k, v in kw.items() if not k.endswith("token_type_ids")}
    assert (logits(eager, no_spans)[real] - truth).abs().max().item() > 100 * (2 * err_ref + 1e-4)


def test_generate_greedy(models):
    name, eager, _, ours = models
    kw = {k: v for k, v in inputs(name).items() if k != "position_ids"}
    # 12 new tokens after a 40-token prompt: decode rows run with the sliding cache truncated.
    a = eager.generate(**kw, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    b = ours.generate(**kw, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(a, b)


def cache_kwarg(model) -> str:
    # transformers renamed past_key_values to cache (5.2x); accept both
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("ctx", [3, 21])
def test_chunked_prefill(models, ctx):
    """A chunk after a cached prefix: queries offset by the cache, an image inside the chunk.
    At ctx=21 the prefix holds the first image and the sliding layers' cache has already dropped
    keys (W=8), so the chunk's keys start at an offset."""
    name, eager, _, ours = models
    kw = {k: v for k, v in row(inputs(name), 0).items() if k not in ("position_ids", "attention_mask")}
    images = {k: v for k, v in kw.items() if k in ("pixel_values", "image_position_ids")}
    split = 0 if ctx < 19 else 1  # images before the chunk end (row 0 has images at 3..18, 21..36)
    types = next(k for k in kw if k.endswith("token_type_ids"))
    results = []
    for model in (eager, ours):
        cache = transformers.DynamicCache(config=model.config.get_text_config())
        first = {"input_ids": kw["input_ids"][:, :ctx], types: kw[types][:, :ctx], "use_cache": True}
        first.update({k: v[:split] for k, v in images.items()} if split else {})
        # transformers' convention: token types of a later chunk cover the prompt from position 0
        rest = dict(kw, input_ids=kw["input_ids"][:, ctx:], use_cache=True)
        rest.update({k: v[split:] for k, v in images.items()})
        with torch.no_grad():
            model(**first, **{cache_kwarg(model): cache})
            results.append(model(**rest, **{cache_kwarg(model): cache}).logits)
    assert (results[0] - results[1]).abs().max().item() < 1e-4


def test_one_plan_per_layer_kind(models, monkeypatch):
    name, _, _, ours = models
    calls = []
    real_plan = spanattn.plan
    monkeypatch.setattr(spanattn, "plan", lambda *a, **k: calls.append(a[1]) or real_plan(*a, **k))
    logits(ours, inputs(name))
    assert sorted(map(repr, calls)) == sorted(map(repr, set(calls))) and len(calls) == 2


def test_policies():
    g3 = build("gemma3").config.text_config
    g4 = build("gemma4").config.text_config
    g4_small = build("gemma4", bidir=None).config.text_config
    mask = spanattn.LayerMask
    assert sahf.layer_mask(g3, W) == mask(W, "clamp") and sahf.layer_mask(g3, None) == mask(None, "on")
    assert sahf.layer_mask(g4, W) == mask(W, "clamp") and sahf.layer_mask(g4, None) == mask(None, "off")
    assert sahf.layer_mask(g4_small, W) == mask(W, "off") and sahf.span_source(g4_small) is None


def test_small_gemma4_is_plain_causal():
    eager = build("gemma4", bidir=None)
    ours = sahf.enable(copy.deepcopy(eager), backend="sdpa")
    kw = inputs("gemma4")
    real = kw["attention_mask"].bool()
    assert (logits(eager, kw) - logits(ours, kw)).abs()[real].max().item() < 1e-4


def test_errors(models):
    name, eager, _, ours = models
    kw = inputs(name)
    kw["attention_mask"] = kw["attention_mask"].flip(1)  # right padding
    with pytest.raises(ValueError, match="left padding"):
        logits(ours, kw)
    plain = copy.deepcopy(eager)
    sahf.register()
    plain.config.get_text_config()._attn_implementation = sahf.NAME
    with pytest.raises(RuntimeError, match="enable"):
        logits(plain, inputs(name))


def test_enable_twice_then_disable(models):
    name, eager, _, _ = models
    model = copy.deepcopy(eager)
    sahf.enable(sahf.enable(model), backend="reference")
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    assert hooks == len(model._spanattn_state.hooks) // 2 > 0  # the first enable's hooks are gone
    kw = inputs(name)
    real = kw["attention_mask"].bool()
    assert (logits(model, kw) - logits(eager, kw)).abs()[real].max().item() < 1e-4
    sahf.disable(model)
    assert model.config.get_text_config()._attn_implementation == "eager"
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert torch.equal(logits(model, kw), logits(eager, kw))


def test_triton_backend(models):
    """The path a GPU takes (Triton's interpreter on CPU): packed padded rows, a batch-1 strided
    view, decode steps through the split-KV kernel."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    name, eager, _, _ = models
    model = sahf.enable(copy.deepcopy(eager), backend="triton")
    kw = {k: v for k, v in inputs(name).items() if k != "position_ids"}
    one = row(kw, 0)
    assert (logits(model, one) - logits(eager, one)).abs().max().item() < 1e-4
    a = eager.generate(**kw, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(a, model.generate(**kw, max_new_tokens=4, min_new_tokens=4, do_sample=False))


def test_chunk_cutting_an_image(models):
    """A forward whose keys end inside an image: an error by default; with allow_split_spans the
    image is cut at the chunk end, which is what transformers does."""
    name, eager, _, ours = models
    types = next(k for k in inputs(name) if k.endswith("token_type_ids"))
    torch.manual_seed(2)
    kw = {"inputs_embeds": torch.randn(1, 10, TEXT["hidden_size"]), types: row(inputs(name), 0)[types]}
    if name == "gemma4":  # per-layer inputs would be recovered from the embeddings (slow, unused here)
        kw["per_layer_inputs"] = torch.zeros(1, 10, TEXT["num_hidden_layers"], 8)
    with pytest.raises(ValueError, match="allow_split_spans=True"):
        logits(ours, kw)
    split = sahf.enable(copy.deepcopy(eager), backend="sdpa", allow_split_spans=True)
    assert (logits(split, kw) - logits(eager, kw)).abs().max().item() < 1e-4
