"""transformers as the semantic oracle: the dense masks that Gemma 3's and Gemma 4's own mask
builders (``create_masks_for_vision_model`` + ``get_block_sequence_ids_for_mask``) produce must
equal ``spanattn.plan(...).to_dense`` exactly, including images wider than the sliding window,
text after an image, query offsets (a KV cache already holding a prefix) and random layouts.

Policies under test (DESIGN.md section 1): Gemma 3 sliding = clamp, full = on; Gemma 4 with
``use_bidirectional_attention="vision"`` sliding = clamp, full = off.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spanattn as sa

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402

gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")

LAYER_TYPES = ["sliding_attention", "full_attention"]
MODELS = {
    # name: (module, vision types, {layer type: span mode})
    "gemma3": (modeling_gemma3, (1,), {"sliding_attention": "clamp", "full_attention": "on"}),
    "gemma4": (gemma4, (1, 2), {"sliding_attention": "clamp", "full_attention": "off"}),
}


def text_config(model: str, window: int, attn: str):
    """A two-layer text config (one sliding, one full); only the mask fields matter here."""
    common = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=window,
        layer_types=LAYER_TYPES,
    )
    if model == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common)
    else:
        cfg = transformers.Gemma4TextConfig(
            **common, use_bidirectional_attention="vision", hidden_size_per_layer_input=0
        )
    cfg._attn_implementation = attn
    return cfg


def hf_masks(model: str, types: list[int], ctx: int, kv_len: int, window: int, attn: str) -> dict:
    """transformers' masks for the chunk ``[ctx, kv_len)`` of a prompt with token types ``types``,
    as bool ``[q_len, kv]`` per layer type. The KV cache is a DynamicCache already holding
    ``ctx`` tokens, so sliding layers see only the last ``window - 1`` cached keys: the returned
    masks cover the trailing keys, and their width says how many."""
    module = MODELS[model][0]
    cfg = text_config(model, window, attn)
    q_len = kv_len - ctx
    embeds = torch.zeros(1, q_len, cfg.hidden_size)
    cache = None
    if ctx:
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            kv = torch.zeros(1, 1, ctx, 8)
            cache.update(kv, kv, layer)
    position_ids = torch.arange(ctx, kv_len)[None]
    ids = torch.tensor([types])
    block_ids = module.get_block_sequence_ids_for_mask(ids, device=embeds.device)
    # Positional arguments: the cache argument was renamed between transformers releases.
    masks = module.create_masks_for_vision_model(cfg, embeds, None, cache, position_ids, block_ids)
    return {kind: as_bool(m, q_len, kv_len) for kind, m in masks.items()}


def as_bool(mask, q_len: int, kv_len: int) -> torch.Tensor:
    """Bool ``[q_len, kv]`` from an SDPA bool mask, an eager additive mask, or SDPA's ``None``
    (which means lower-right-aligned causal over all ``kv_len`` keys)."""
    if mask is None:
        k = torch.arange(kv_len)
        return k[None, :] <= (torch.arange(q_len) + kv_len - q_len)[:, None]
    mask = mask[0, 0]
    return mask if mask.dtype == torch.bool else mask == 0


def ours(model: str, types: list[int], ctx: int, kv_len: int, window: int, kind: str) -> torch.Tensor:
    _, vision_types, modes = MODELS[model]
    spans = sa.spans_from_token_types(types, vision_types)
    seq = sa.Seq(q_len=kv_len - ctx, kv_len=kv_len, spans=spans, prompt_len=len(types))
    w = window if kind == "sliding_attention" else None
    # transformers caps a span at the chunk end; spanattn raises unless asked to do the same.
    batch = sa.Batch([seq], allow_split_spans=True)
    return sa.plan(batch, sa.LayerMask(window=w, spans=modes[kind])).to_dense(0)


def check(model: str, types: list[int], ctx: int, kv_len: int, window: int, attn: str = "eager"):
    for kind, theirs in hf_masks(model, types, ctx, kv_len, window, attn).items():
        mine = ours(model, types, ctx, kv_len, window, kind)
        dropped = kv_len - theirs.shape[1]
        # A sliding cache may have dropped the oldest keys: none of them may be needed.
        assert not mine[:, :dropped].any(), f"{model} {kind}: a dropped cache key is allowed"
        mine = mine[:, dropped:]
        assert torch.equal(mine, theirs), (
            f"{model} {kind} (ctx={ctx}, kv_len={kv_len}, W={window}, types={types})\n"
            + differing_rows(theirs, mine, ctx, dropped)
        )


def differing_rows(theirs: torch.Tensor, mine: torch.Tensor, ctx: int, dropped: int) -> str:
    """The rows that differ, one line each, '#' = attend, keys from position ``dropped``."""
    draw = lambda row: "".join("#" if x else "." for x in row.tolist())
    bad = (theirs != mine).any(1).nonzero().flatten().tolist()
    return "\n".join(
        f"q={ctx + i:3d} transformers {draw(theirs[i])}\n      spanattn     {draw(mine[i])}" for i in bad
    )


def layout(*parts: tuple[int, int]) -> list[int]:
    """Token types from ``(type, count)`` runs."""
    return [t for t, n in parts for _ in range(n)]


# Several images, one wider than the window (W=4, 9 tokens), text between and after them; the
# Gemma 4 one mixes types 1 and 2 inside one item and puts two items back to back.
FIXED = {
    "gemma3": layout((0, 3), (1, 9), (0, 2), (1, 3), (0, 4), (1, 1), (0, 3)),
    "gemma4": layout((0, 2), (1, 6), (2, 3), (0, 3), (2, 2), (0, 1), (1, 5), (0, 4)),
}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_full_prefill(model, attn):
    types = FIXED[model]
    for window in (1, 2, 4, 7, len(types) + 3):
        check(model, types, 0, len(types), window, attn)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_query_offsets(model):
    """Chunks whose first query sits before, inside and after an image, decode rows included."""
    types = FIXED[model]
    for ctx in (1, 3, 5, 11, 14, len(types) - 1):
        for window in (2, 4, 6):
            check(model, types, ctx, len(types), window)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chunk_inside_prompt(model):
    """A chunk that ends before the prompt does; transformers caps a cut span at the chunk end."""
    types = FIXED[model]
    for ctx, kv_len in ((0, 7), (3, 8), (4, 15), (12, 17)):
        check(model, types, ctx, kv_len, 4)


@st.composite
def random_layout(draw):
    runs = draw(st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(1, 12)), min_size=1, max_size=7))
    types = layout(*runs)
    kv_len = draw(st.integers(1, len(types)))
    ctx = draw(st.one_of(st.integers(0, kv_len - 1), st.just(kv_len - 1), st.just(0)))
    # small windows most of the time: images wider than the window are the interesting case
    window = draw(st.one_of(st.integers(1, 6), st.integers(1, len(types) + 2)))
    return types, ctx, kv_len, window


@pytest.mark.parametrize("model", sorted(MODELS))
@settings(max_examples=30, deadline=None)
@given(case=random_layout())
def test_random_layouts(model, case):
    types, ctx, kv_len, window = case
    if model == "gemma3":
        types = [1 if t == 1 else 0 for t in types]  # type 2 is not an image token for Gemma 3
    check(model, types, ctx, kv_len, window)
