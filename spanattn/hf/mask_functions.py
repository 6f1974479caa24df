"""The mask a model's own code builds, read back in spanattn's terms.

transformers composes every mask from a few index functions of ``masking_utils``: causal,
bidirectional, a past sliding window (``sliding_window_overlay``), image blocks
(``blockwise_overlay(block_sequence_ids)``), joined by ``and_masks`` / ``or_masks``. Each family's
mask code picks a composition; this module reads it back from the functions' closures (never by
evaluating it over ``[q, kv]``) and names the layer policy it equals:

    causal                                  LayerMask(None, "off")
    and(causal, window W)                   LayerMask(W, "off")
    or(causal, blocks)                      LayerMask(None, "on")     e.g. Gemma 3 global layers
    or(and(causal, window W), blocks)       LayerMask(W, "on")        e.g. PaliGemma 2 sliding layers
    and(or(causal, blocks), window W)       LayerMask(W, "clamp")     e.g. Gemma 3 / 4 sliding layers
    bidirectional                           non-causal rows, every key (DiffusionGemma's canvas)
    and(F at positions, samples)            F in each sample of a packed row, nothing across samples

Any other composition is refused with its formula, e.g. ``or(causal, gemma3._bidirectional_window_overlay)``.

A packed row (several samples, position ids that restart per sample: transformers'
``DataCollatorWithFlattening``) gets ``and(F', packed_sequence_mask_function(sample ids))``, where
``F'`` is ``F`` with its causal and window parts evaluated at the tokens' position ids
(``remap_positions_for_packed_sequence``). Within a sample positions run consecutively, so causal
and window parts are the same at indices; the sample ids become :attr:`MaskRule.samples` and each
sample one spanattn sequence. Where a family's image blocks sit inside ``F'`` (Gemma 3's sliding
layers), transformers reads the block ids at the positions, which for every sample after the first
are another sample's tokens; spanattn reads them at the sample's own tokens, what its token types
say. Older transformers (5.17) put the blocks outside the packed mask (``or(and(causal, samples),
blocks)``: an image could see another sample's): refused with its formula.

>>> from transformers import masking_utils as mu
>>> fn = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(None)),
...                   mu.sliding_window_overlay(512))
>>> read_mask_function(fn).layer
LayerMask(window=512, spans='clamp', noncausal_window='exclusive')
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

import spanattn as sa


@dataclass(frozen=True)
class MaskRule:
    """A layer kind's mask: the policy, whether its rows are causal, and the block ids
    (``[batch, positions]``, -1 outside any block) whose runs are its spans; samples: the sample
    ids of packed rows (``[batch, positions]``, nondecreasing along a row), None unless packed."""

    layer: sa.LayerMask
    causal: bool = True
    blocks: Any = None
    samples: Any = None


@functools.cache
def _kinds() -> dict:
    """Code objects of transformers' composable mask functions, by what they mean."""
    from transformers import masking_utils as mu

    kinds = {
        mu.and_masks(mu.causal_mask_function).__code__: "and",
        mu.or_masks(mu.causal_mask_function).__code__: "or",
        mu.sliding_window_overlay(1).__code__: "window",
        mu.blockwise_overlay(None).__code__: "blocks",
        mu.packed_sequence_mask_function(None).__code__: "samples",
    }
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # transformers >= 5.2x
        kinds[mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__] = "positions"
    return kinds


def _leaf(fn) -> str | None:
    from transformers import masking_utils as mu

    return {mu.causal_mask_function: "causal", mu.bidirectional_mask_function: "bidirectional"}.get(fn)


def _closure(fn) -> dict:
    cells = fn.__closure__ or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def tree(fn) -> tuple:
    """``fn`` as nested ``(kind, value)``: ("and" | "or", [children]), ("window", W),
    ("blocks", ids), ("samples", ids), ("positions", child: evaluated at position ids),
    ("causal", None), ("bidirectional", None), or ("unknown", fn)."""
    leaf = _leaf(fn)
    if leaf:
        return (leaf, None)
    kind = _kinds().get(getattr(fn, "__code__", None))
    try:
        cells = _closure(fn)
        if kind in ("and", "or"):
            children = []
            for child in map(tree, cells["mask_functions"]):  # nested and(and(..)) flattens
                children.extend(child[1] if child[0] == kind else [child])
            return (kind, children)
        if kind == "window":
            return (kind, int(cells["sliding_window"]))
        if kind == "blocks":
            return (kind, cells["block_sequence_ids"])
        if kind == "samples":
            return (kind, cells["packed_sequence_mask"])
        if kind == "positions":
            return (kind, tree(cells["mask_function"]))
    except (KeyError, TypeError, ValueError):  # a transformers version that stores them differently
        pass
    return ("unknown", fn)


def formula(node: tuple) -> str:
    """A readable form of a :func:`tree`, for error messages."""
    kind, value = node
    if kind in ("and", "or"):
        return f"{kind}({', '.join(map(formula, value))})"
    if kind == "window":
        return f"window {value}"
    if kind == "positions":
        return f"at_positions({formula(value)})"
    if kind == "unknown":
        module = getattr(value, "__module__", "") or ""
        return f"{module.rsplit('.', 1)[-1]}.{getattr(value, '__qualname__', repr(value))}"
    return kind


def is_bidirectional(fn) -> bool:
    """Whether ``fn`` starts from transformers' bidirectional mask (``create_bidirectional_mask``
    and the encoders built on it): its first leaf, following the first child of each and/or."""
    node = tree(fn)
    while node[0] in ("and", "or", "positions") and node[1]:
        node = node[1] if node[0] == "positions" else node[1][0]
    return node[0] == "bidirectional"


def _at_indices(node: tuple) -> tuple:
    """``node`` with every ``positions`` wrapper removed (and/or flattened again): within one
    sample of a packed row position ids are consecutive, so its rule is the same at indices."""
    kind, value = node
    if kind == "positions":
        return _at_indices(value)
    if kind not in ("and", "or"):
        return node
    children = []
    for child in map(_at_indices, value):
        children.extend(child[1] if child[0] == kind else [child])
    return (kind, children)


def _rule(node: tuple) -> MaskRule | None:
    kind, value = node
    samples = [v for k, v in value if k == "samples"] if kind == "and" else []
    if samples:  # a packed row: and(rule at positions, samples)
        rest = [child for child in value if child[0] != "samples"]
        if len(samples) != 1 or not rest:
            return None
        inner = _rule(_at_indices(rest[0] if len(rest) == 1 else (kind, rest)))
        return None if inner is None else replace(inner, samples=samples[0])
    if kind == "causal":
        return MaskRule(sa.LayerMask(None, "off"))
    if kind == "bidirectional":
        return MaskRule(sa.LayerMask(None, "off"), causal=False)
    if kind not in ("and", "or"):
        return None
    split = "blocks" if kind == "or" else "window"
    picked = [v for k, v in value if k == split]
    rest = [child for child in value if child[0] != split]
    if len(picked) != 1 or not rest:
        return None
    inner = _rule(rest[0] if len(rest) == 1 else (kind, rest))
    if inner is None or not inner.causal or inner.samples is not None:  # samples: only outermost
        return None
    if kind == "or" and inner.layer.spans == "off":  # (causal [AND window]) OR block
        return replace(inner, layer=sa.LayerMask(inner.layer.window, "on"), blocks=picked[0])
    if kind == "and" and inner.layer.window is None:  # causal AND window, (causal OR block) AND window
        spans = "clamp" if inner.layer.spans == "on" else "off"
        return replace(inner, layer=sa.LayerMask(picked[0], spans))
    return None


def block_spans(blocks, batch: int) -> dict[int, list[tuple[int, ...]]]:
    """A rule's block ids read as spans, per batch row, from ONE device-to-host copy: every
    maximal run of one block id (>= 0) is a span ``(start, end)``, inclusive; a block made of
    several separate runs is a span group, its runs ``(start, end, block)`` (Molmo2 puts every
    image and video-frame token of a row in block 0, the text between them outside any).

    >>> import torch
    >>> block_spans(torch.tensor([[-1, 0, 0, -1, 0, -1, 1, 1]]), 1)
    {0: [(1, 2, 0), (4, 4, 0), (6, 7)]}
    """
    ids = blocks.long()
    inside = ids >= 0
    before = torch.nn.functional.pad(ids, (1, 0), value=-1)[:, :-1]
    after = torch.nn.functional.pad(ids, (0, 1), value=-1)[:, 1:]
    starts, ends = inside & (ids != before), inside & (ids != after)
    # nonzero lists (row, position) row-major, so the k-th start and the k-th end make one run
    runs = torch.cat([starts.nonzero(), ends.nonzero()[:, 1:], ids[starts][:, None]], 1).tolist()
    count = Counter((row, block) for row, _, _, block in runs)
    by_row = {}
    for row, s, e, block in runs:
        by_row.setdefault(row, []).append((s, e) if count[row, block] == 1 else (s, e, block))
    if ids.shape[0] == 1 and batch > 1:  # one row of block ids for the whole batch
        by_row = {row: by_row.get(0, []) for row in range(batch)}
    return by_row


def read_mask_function(fn) -> MaskRule:
    """The :class:`MaskRule` that one of transformers' mask functions equals; raises
    ``NotImplementedError`` with its formula when spanattn has no policy for it."""
    node = tree(fn)
    rule = _rule(node)
    if rule is None:
        raise NotImplementedError(
            f"spanattn.hf cannot run the mask {formula(node)}: it serves causal masks with a sliding "
            "window and image blocks (or(causal, blocks), and(or(causal, blocks), window), ...) and "
            "bidirectional canvases"
        )
    return rule
