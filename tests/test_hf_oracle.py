"""transformers as the semantic oracle: for every family, the masks its own mask code builds under
``attn_implementation="eager"`` (dense) must equal, exactly, the plans spanattn.hf builds from the
same call (``StepMask`` -> ``Plan.to_dense``): random layouts of text and images (images wider
than the window), left padding, a cache already holding a prefix (DynamicCache, whose sliding
layers drop old keys, or StaticCache, whose buffer is longer than the filled part), chunks that
end before the prompt does.

The policies this pins down, read from each family's mask code:
Gemma 3 sliding = clamp, full = on; Gemma 4 sliding = clamp, full = off (and Gemma 4 unified's
generate() with a static cache); Gemma 4 unified forward, DiffusionGemma encoder, PaliGemma 2
sliding = on with the window; PaliGemma, Molmo2, PI0 full = on (PaliGemma's token type 0 is the
block); DiffusionGemma's decoder canvas: non-causal over every key its layer keeps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spanattn.hf as sahf
from spanattn.hf.options import Options, set_options

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from transformers import masking_utils  # noqa: E402


def _text(config):
    return config.get_text_config() if not isinstance(config, transformers.PI0Config) else config.dit_config


def _generate_masks(model_class: str, key: str):
    """The family's ``create_masks_for_generate`` (what its forward builds as well)."""

    def build(config, embeds, pad, cache, position_ids, types):
        cls = getattr(transformers, model_class)
        return cls.create_masks_for_generate(config, embeds, pad, cache, position_ids, **{key: types})

    return build


def _unified_forward(config, embeds, pad, cache, position_ids, types):
    """Gemma 4 unified's forward: image blocks into both layer kinds' masks, no clamp."""
    from transformers.models.gemma4_unified import modeling_gemma4_unified as unified

    blocks = unified.get_block_sequence_ids_for_mask(types, device=types.device)
    return masking_utils.create_masks_for_generate(
        _text(config), embeds, pad, cache, position_ids, block_sequence_ids=blocks
    )


def _pi0(config, embeds, pad, cache, position_ids, types):
    """PI0's mask over the prefix its VLM cached plus state and actions (built in its forward):
    the prefix and the state one block, the actions another."""
    prefix, q = cache.get_seq_length(), embeds.shape[1]
    blocks = torch.tensor([0] * (prefix + 1) + [1] * (q - 1))[None].repeat(embeds.shape[0], 1)
    # positional: the cache argument was renamed in 5.2x
    return masking_utils.create_causal_mask(config.dit_config, embeds, pad, cache, block_sequence_ids=blocks)


# name: (family, token values a layout draws from, the family's mask construction)
BUILDERS = {
    "gemma3": ("gemma3", (0, 1), _generate_masks("Gemma3ForConditionalGeneration", "token_type_ids")),
    "gemma4": ("gemma4", (0, 1, 2), _generate_masks("Gemma4ForConditionalGeneration", "mm_token_type_ids")),
    "gemma4_unified": ("gemma4_unified", (0, 1, 2), _unified_forward),
    "gemma4_unified_static_generate": (
        "gemma4_unified",
        (0, 1, 2),
        _generate_masks("Gemma4UnifiedForConditionalGeneration", "mm_token_type_ids"),
    ),
    "diffusion_gemma": (
        "diffusion_gemma",
        (0, 1, 2),
        _generate_masks("DiffusionGemmaEncoderModel", "mm_token_type_ids"),
    ),
    "paligemma": (
        "paligemma",
        (0, 1),
        _generate_masks("PaliGemmaForConditionalGeneration", "token_type_ids"),
    ),
    "paligemma2": (
        "paligemma2",
        (0, 1),
        _generate_masks("PaliGemmaForConditionalGeneration", "token_type_ids"),
    ),
    "molmo2": ("molmo2", (0, 1), _generate_masks("Molmo2ForConditionalGeneration", "mm_token_type_ids")),
    "pi0": ("pi0", None, _pi0),
}


def config(family: str, window: int, attn: str):
    cfg = hm._config(family)
    text = _text(cfg)
    if getattr(text, "sliding_window", None) is not None:
        text.sliding_window = window
    for c in (cfg, text):  # some mask code reads the model's config (DiffusionGemma's decoder)
        c._attn_implementation_internal = attn
        # transformers caps an image at the chunk end; spanattn raises unless asked to do the same
        set_options(c, Options(allow_split_spans=True) if attn == sahf.NAME else None)
    return cfg


def filled_cache(cfg, kind: str, batch: int, ctx: int, length: int):
    """A cache already holding ``ctx`` tokens of every layer (their values do not matter here)."""
    if not ctx:
        return (
            None
            if kind == "dynamic"
            else transformers.StaticCache(config=_text(cfg), max_cache_len=length + 3)
        )
    text = _text(cfg)
    cache = (
        transformers.DynamicCache(config=text)
        if kind == "dynamic"
        else transformers.StaticCache(config=text, max_cache_len=length + 3)
    )
    for layer in range(len(cache.layers)):
        if not getattr(cache, "is_dummy", [False] * (layer + 1))[layer]:  # Gemma 4's KV-shared layers
            kv = torch.zeros(batch, 1, ctx, 8)
            cache.update(kv, kv, layer)
    return cache


def as_dense(mask, step_like: sahf.StepMask | None, q_len: int) -> torch.Tensor:
    """Bool ``[batch, q, kv]`` from an eager additive mask, or from a StepMask's plans."""
    if step_like is None:
        return mask[:, 0] == 0
    batch, _, _, kv = step_like.shape
    out = torch.zeros(batch, q_len, kv, dtype=torch.bool)
    plan, rows = step_like.plan(q_len, kv, torch.device("cpu"))
    for i, r in enumerate(rows):
        out[r.row, r.q0 : r.q1, r.k0 : r.k1] = plan.to_dense(i)
    return out


def build_masks(name: str, types, pads, ctx: int, kv_len: int, window: int, cache_kind: str, attn: str):
    family, _, builder = BUILDERS[name]
    cfg = config(family, window, attn)
    batch, length = types.shape
    q_len = kv_len - ctx
    pad = (torch.arange(length)[None] >= torch.tensor(pads)[:, None])[:, :kv_len]
    cache = filled_cache(cfg, cache_kind, batch, ctx, length)
    embeds = torch.zeros(batch, q_len, 16)
    position_ids = torch.arange(ctx, kv_len)[None]
    masks = builder(cfg, embeds, pad, cache, position_ids, types)
    return masks if isinstance(masks, dict) else {"full_attention": masks}


def check(name, types, pads, ctx, kv_len, window, cache_kind):
    theirs = build_masks(name, types, pads, ctx, kv_len, window, cache_kind, "eager")
    ours = build_masks(name, types, pads, ctx, kv_len, window, cache_kind, sahf.NAME)
    q_len = kv_len - ctx
    assert theirs.keys() == ours.keys()
    for kind, mask in theirs.items():
        try:
            mine = as_dense(None, ours[kind], q_len)
        except NotImplementedError as err:  # an image whose start a sliding cache dropped
            assert "dropped keys" in str(err) and ours[kind].rule.layer.spans == "on", err
            continue
        want = as_dense(mask, None, q_len)
        for b, p in enumerate(pads):  # padding queries: eager fills noise there, spanattn zeros
            real = slice(max(0, p - ctx), None)
            assert torch.equal(mine[b, real], want[b, real]), (
                f"{name} {kind} row {b}: ctx={ctx} kv_len={kv_len} W={window} {cache_kind} pads={pads}\n"
                + draw(want[b, real], mine[b, real], max(ctx, p))
            )


def draw(theirs, mine, first: int) -> str:
    row = lambda r: "".join("#" if x else "." for x in r.tolist())
    bad = (theirs != mine).any(1).nonzero().flatten().tolist()
    return "\n".join(
        f"q={first + i:3d} transformers {row(theirs[i])}\n      spanattn     {row(mine[i])}" for i in bad
    )


@st.composite
def layouts(draw, name: str):
    values = BUILDERS[name][1]
    batch = draw(st.integers(1, 2))
    if name.startswith("paligemma"):  # a prefix (type 0) then a suffix (type 1)
        runs = [[(0, draw(st.integers(1, 14))), (1, draw(st.integers(1, 6)))] for _ in range(batch)]
    elif name == "pi0":
        runs = [[(0, draw(st.integers(2, 14)))] for _ in range(batch)]
    else:
        run = st.tuples(st.sampled_from(values), st.integers(1, 10))
        runs = [draw(st.lists(run, min_size=1, max_size=5)) for _ in range(batch)]
    rows = [[t for t, n in r for _ in range(n)] for r in runs]
    length = max(map(len, rows))
    pads = [length - len(r) for r in rows]
    types = torch.tensor([[0] * p + r for p, r in zip(pads, rows)])
    if name == "pi0":  # the whole prompt is cached; the step is the state and the actions
        chunk = draw(st.integers(2, 6))
        return (
            types,
            pads,
            length,
            length + chunk,
            draw(st.integers(1, 9)),
            draw(st.sampled_from(["dynamic", "static"])),
        )
    kv_len = draw(st.one_of(st.just(length), st.integers(1, length)))
    ctx = draw(st.one_of(st.just(0), st.integers(0, kv_len - 1)))
    if name in ("paligemma", "paligemma2", "molmo2") and ctx:
        ctx = min(ctx, length - 1)  # their blocks apply to prefill steps, which hold the whole prompt
    return types, pads, ctx, kv_len, draw(st.integers(1, 9)), draw(st.sampled_from(["dynamic", "static"]))


@pytest.mark.parametrize("name", list(BUILDERS))
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_random_layouts(name, data):
    if not hm.available(BUILDERS[name][0]):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    types, pads, ctx, kv_len, window, cache_kind = data.draw(layouts(name))
    if name == "pi0":
        types = torch.zeros(len(pads), kv_len, dtype=torch.long)
    check(name, types, pads, ctx, kv_len, window, cache_kind)


def test_diffusion_gemma_canvas():
    """The decoder's canvas over the prefix each layer keeps plus the canvas, left-padded."""
    if not hm.available("diffusion_gemma"):
        pytest.skip("no DiffusionGemma in this transformers")
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaDecoderModel

    for prefix in (3, 7, 12):  # within and past the window (W=8)
        pads = [0, 2]
        pad = torch.arange(prefix + hm.CANVAS)[None] >= torch.tensor(pads)[:, None]
        out = {}
        for attn in ("eager", sahf.NAME):
            cfg = config("diffusion_gemma", hm.W, attn)
            cache = filled_cache(cfg, "dynamic", 2, prefix, prefix)
            out[attn] = DiffusionGemmaDecoderModel.create_diffusion_decoder_attention_mask(
                cfg, torch.zeros(2, hm.CANVAS, 16), cache, pad
            )
        for kind, mask in out["eager"].items():
            mine, want = as_dense(None, out[sahf.NAME][kind], hm.CANVAS), as_dense(mask, None, hm.CANVAS)
            assert torch.equal(mine, want), (kind, prefix)
