"""Tiny random transformers models of every family spanattn.hf serves (nothing downloaded), and
left-padded two-row inputs with images wider than the sliding window (W=8, 16 tokens each).

``build(name)`` gives an fp32 eager model; ``inputs(name)`` a batch whose row 0 is unpadded and
row 1 left-padded; ``right_padded`` moves the padding to the right; ``row(name, kw, 0)`` row 0
alone; ``rel`` the error the tests bound; importing ``one_thread`` runs a test module on one CPU
thread. Families whose tower is cheap get pixel values; the others mark image tokens by their token
types only (all the mask needs). Training: ``loss`` (each family's objective), ``gradients`` and
``gradient_error``.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import transformers

IMG, W, LENGTH = 5, 8, 40
LAYERS = ["sliding_attention", "full_attention"] * 2
TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)
GEMMA4_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    patch_size=4,
    pooling_kernel_size=2,
)
GEMMA4_TEXT = dict(
    TEXT, sliding_window=W, layer_types=LAYERS, global_head_dim=32, use_bidirectional_attention="vision"
)
GEMMA4_IDS = dict(image_token_id=IMG, boi_token_id=6, eoi_token_id=7)

# name: (transformers module that must exist, key of the token types, how many images row 0 has)
FAMILIES = {
    "gemma3": ("gemma3", "token_type_ids", 2),
    "gemma4": ("gemma4", "mm_token_type_ids", 2),
    "gemma4_unified": ("gemma4_unified", "mm_token_type_ids", 2),
    "diffusion_gemma": ("diffusion_gemma", "mm_token_type_ids", 2),
    "paligemma": ("paligemma", "token_type_ids", 1),
    "paligemma2": ("paligemma", "token_type_ids", 1),
    "molmo2": ("molmo2", "mm_token_type_ids", 2),  # ONE block: the two images are a span group
    "pi0": ("pi0", None, 1),
}
CANVAS = 4  # DiffusionGemma's canvas length
PI0 = dict(chunk=5, state=6)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with other jobs on the CPU, a second spinning thread costs 10-20x. Autouse
    in every test module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def available(name: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{FAMILIES[name][0]}") is not None


def _config(name: str):
    t = transformers
    if name == "gemma3":
        vision = {k: v for k, v in SIGLIP.items() if k != "model_type"}
        return t.Gemma3Config(
            text_config=dict(TEXT, sliding_window=W, layer_types=LAYERS),
            vision_config=vision,
            mm_tokens_per_image=16,
            image_token_id=IMG,
        )
    if name == "gemma4":
        text = dict(
            GEMMA4_TEXT, num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64
        )
        ids = dict(GEMMA4_IDS, video_token_id=8, audio_token_id=9)
        return t.Gemma4Config(text_config=text, vision_config=GEMMA4_VISION, **ids)
    if name == "gemma4_unified":
        ids = dict(GEMMA4_IDS, video_token_id=8, audio_token_id=9, boa_token_id=10)
        return t.Gemma4UnifiedConfig(text_config=dict(GEMMA4_TEXT, num_kv_shared_layers=2), **ids)
    if name == "diffusion_gemma":
        text = dict(GEMMA4_TEXT, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
        vision = dict(GEMMA4_VISION, model_type="gemma4_vision")
        return t.DiffusionGemmaConfig(
            text_config=text, vision_config=vision, canvas_length=CANVAS, **GEMMA4_IDS
        )
    if name in ("paligemma", "paligemma2", "pi0"):
        text = dict(TEXT, model_type="gemma")
        if name == "paligemma2":  # Gemma 2: sliding layers, logit softcaps
            text.update(
                model_type="gemma2",
                sliding_window=W,
                layer_types=LAYERS,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            )
        vlm = dict(
            text_config=text,
            vision_config=SIGLIP,
            image_token_index=IMG,
            vocab_size=64,
            projection_dim=32,
            hidden_size=32,
        )
        if name != "pi0":
            return t.PaliGemmaConfig(**vlm)
        dit = dict(TEXT, model_type="gemma", hidden_size=16, intermediate_size=32)
        return t.PI0Config(
            vlm_config=dict(vlm, model_type="paligemma"),
            dit_config=dit,
            chunk_size=PI0["chunk"],
            max_state_dim=PI0["state"],
            max_action_dim=PI0["state"],
            num_inference_steps=3,
        )
    if name == "molmo2":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
        )
        adapter = dict(vision, text_hidden_size=32, vision_feature_layer=[-1])
        ids = dict(
            image_patch_id=IMG,
            image_start_token_id=6,
            low_res_image_start_token_id=7,
            image_end_token_id=8,
            frame_start_token_id=9,
            frame_end_token_id=10,
        )
        return t.Molmo2Config(
            text_config=dict(TEXT, additional_vocab_size=8),
            vision_config=vision,
            adapter_config=adapter,
            **ids,
        )
    raise KeyError(name)


MODEL_CLASSES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
    "diffusion_gemma": "DiffusionGemmaForBlockDiffusion",
    "paligemma": "PaliGemmaForConditionalGeneration",
    "paligemma2": "PaliGemmaForConditionalGeneration",
    "molmo2": "Molmo2ForConditionalGeneration",
    "pi0": "PI0ForConditionalGeneration",
}


def build(name: str, attn: str = "eager"):
    """An fp32 model with random weights (seed 0)."""
    torch.manual_seed(0)
    cfg = _config(name)
    cfg._attn_implementation = attn
    return getattr(transformers, MODEL_CLASSES[name])(cfg).eval()


def _layout(name: str) -> list[list[int]]:
    """Token ids of the two rows, ``0`` for padding. PaliGemma: image and prompt are the prefix,
    then the suffix; the others put text before, between and after their images."""
    img = [IMG] * 16
    if name.startswith("paligemma") or name == "pi0":
        rows = [img + [2, 9, 10, 11, 12, 3], [0] * 3 + img + [2, 9, 3]]
        if name != "pi0":
            rows = [rows[0] + [30, 31, 32, 33, 34], rows[1] + [40, 41, 42, 43, 44]]
        return rows
    first = [2, 9, 10] + img + [11, 12] + (img if FAMILIES[name][2] == 2 else [20] * 16) + [13, 14, 15]
    return [first, [0] * 20 + [2, 20] + img + [21, 22]]


def images_in(tokens: list[int]) -> int:
    return sum(1 for i, t in enumerate(tokens) if t == IMG and (i == 0 or tokens[i - 1] != IMG))


def images(name: str, count: int) -> dict:
    if name in ("gemma3", "paligemma", "paligemma2"):
        return {"pixel_values": torch.randn(count, 3, 16, 16)}
    if name in ("gemma4", "diffusion_gemma"):
        xy = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).reshape(
            1, 64, 2
        )
        return {"pixel_values": torch.randn(count, 64, 48), "image_position_ids": xy.repeat(count, 1, 1)}
    if name == "pi0":
        return {
            "pixel_values": torch.randn(2, 1, 3, 16, 16),
            "pixel_attention_mask": torch.ones(2, 1, dtype=torch.bool),
        }
    return {}


def inputs(name: str, pixels: bool = True) -> dict:
    """Two left-padded rows (row 1 padded). PI0's also hold its state and action noise."""
    torch.manual_seed(1)
    rows = _layout(name)
    ids = torch.tensor(rows)
    kw = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    key = FAMILIES[name][1]
    if name.startswith("paligemma"):  # 0: the bidirectional prefix (and padding), 1: the suffix
        kw[key] = torch.tensor([[0] * 22 + [1] * 5] * 2)
    elif key:
        kw[key] = (ids == IMG).long()
    if name == "pi0":
        kw.update(state=torch.randn(2, PI0["state"]), noise=torch.randn(2, PI0["chunk"], PI0["state"]))
    if pixels:
        kw.update(images(name, sum(map(images_in, rows))))
    return kw


def right_padded(name: str, kw: dict, keep_left: int = 0) -> dict:
    """``kw`` with each row's padding moved to its end, but ``keep_left`` tokens of it (rows
    ``1..1 0..0``, or ``0..0 1..1 0..0``: what a training collator gives); images unchanged."""
    out = dict(kw)
    for b, real in enumerate(kw["attention_mask"].bool()):
        shift = max(int((~real).sum()) - keep_left, 0)
        for key in ("input_ids", "attention_mask", FAMILIES[name][1]):
            if key in kw:
                out[key] = out[key].clone()
                out[key][b] = kw[key][b].roll(-shift)
    return out


def row(name: str, kw: dict, b: int) -> dict:
    """Row ``b`` alone and unpadded, its images only."""
    real = kw["attention_mask"][b].bool()
    counts = list(map(images_in, _layout(name)))
    first = sum(counts[:b])
    out = {}
    for k, v in kw.items():
        if k in ("pixel_values", "image_position_ids") and name != "pi0":  # images in row order
            out[k] = v[first : first + counts[b]]
        elif k in ("input_ids", "attention_mask", FAMILIES[name][1]):
            out[k] = v[b : b + 1, real]
        else:  # one entry per row
            out[k] = v[b : b + 1]
    return out


def cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def loss(name: str, model, kw: dict) -> torch.Tensor:
    """The family's training objective on ``kw``: next-token cross-entropy with labels -100 on
    padding for the language models; PI0's flow-matching loss on its actions; DiffusionGemma's
    canvas cross-entropy (the clean canvas from a noised one, over the encoded prompt) plus its
    encoder's next-token loss (``encoder_last_hidden_state``, which transformers returns for it)."""
    real = kw["attention_mask"].bool()
    # a label counts the logits one position before it: none of a padding position (whose output
    # transformers' eager attention leaves undefined and spanattn zero) enters the loss
    before = torch.nn.functional.pad(real, (1, 0), value=True)[:, :-1]
    labels = kw["input_ids"].masked_fill(~(real & before), -100)
    if name == "pi0":
        actions = torch.randn(real.shape[0], PI0["chunk"], PI0["state"], generator=_seed(5))
        return model(**kw, actions=actions, timestep=torch.linspace(0.3, 0.7, real.shape[0])).loss
    if name != "diffusion_gemma":
        return model(**kw, labels=labels).loss
    clean = torch.randint(0, 64, (real.shape[0], CANVAS), generator=_seed(3))
    noised = torch.where(torch.rand(clean.shape, generator=_seed(4)) < 0.5, clean, 1)
    canvas = torch.nn.functional.pad(kw["attention_mask"], (0, CANVAS), value=1)
    out = model(**kw, decoder_input_ids=noised, decoder_attention_mask=canvas)
    encoder_logits = model.lm_head(out.encoder_last_hidden_state)
    ce = torch.nn.functional.cross_entropy
    return ce(out.logits.flatten(0, 1), clean.flatten()) + ce(
        encoder_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def _seed(n: int) -> torch.Generator:
    return torch.Generator().manual_seed(n)


def gradients(name: str, model, kw: dict) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient of :func:`loss` in train mode."""
    model.train()
    model.zero_grad()
    loss(name, model, kw).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def gradient_error(want: dict, got: dict) -> tuple[float, str]:
    """The worst ``(error, parameter)``: each gradient's error relative to its own scale, or to a
    thousandth of the model's largest where the gradient is rounding noise around zero (a key
    projection's bias: softmax ignores it). Asserts that no parameter lost its gradient."""
    missing = sorted(n for n, g in want.items() if g is not None and got[n] is None)
    assert not missing, f"no gradient through spanattn for {missing}"
    floor = 1e-3 * max(g.abs().max() for g in want.values() if g is not None)
    scale = lambda g: max(g.abs().max(), floor)
    return max((((got[n] - g).abs().max() / scale(g)).item(), n) for n, g in want.items() if g is not None)


@functools.cache
def eager_and_spanattn(name: str):
    """(eager model, the same weights through spanattn.hf), built once per test process; skips
    where the installed transformers has no ``name``."""
    import copy

    import spanattn.hf as sahf

    if not available(name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    eager = build(name)
    return eager, sahf.enable(copy.deepcopy(eager))
