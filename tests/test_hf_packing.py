"""Padding-free packing with images through ``attn_implementation="spanattn"``: a row holding
several samples (position ids that restart per sample, as transformers'
``DataCollatorWithFlattening`` gives them, with or without FlashAttention's ``cu_seq_lens_*`` /
``max_length_*`` keywords) runs one spanattn sequence per sample, each sample's images
bidirectional from its own token types, nothing attended across samples.

Held to the samples run one by one under transformers' eager attention (logits and every
parameter's gradient, fp32, tiny random models of tests/hf_models.py), and to the masks
transformers builds for each sample alone (random layouts). transformers' eager packed run agrees
for Gemma 4 unified, PaliGemma and Molmo2; for Gemma 3 and Gemma 4 it does not: their sliding
layers' image blocks sit inside the function transformers evaluates at the position ids, so from
the second sample on they are read at another sample's tokens (spanattn reads each sample's own).
transformers 5.17 composes most families' image blocks outside its packed mask (an image could see
another sample's): spanattn refuses those masks by formula, and these tests stop there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spanattn.hf as sahf

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import IMG, one_thread, rel  # noqa: E402, F401
from test_hf_oracle import BUILDERS, as_dense, config  # noqa: E402

TOL = 1e-5
PACKED = ["gemma3", "gemma4", "gemma4_unified", "paligemma", "paligemma2", "molmo2"]
EAGER_PACKS = ["gemma4_unified", "paligemma", "paligemma2", "molmo2"]  # see the module docstring


@contextlib.contextmanager
def packing_composed_last():
    """Runs the body; on a transformers that ORs image blocks after its packed mask, the refusal
    by formula skips the test instead."""
    try:
        yield
    except NotImplementedError as err:
        if hasattr(transformers.masking_utils, "remap_positions_for_packed_sequence"):
            raise
        assert "samples), blocks)" in str(err), err
        pytest.skip(f"transformers {transformers.__version__} composes image blocks outside its packed mask")


pair = hm.eager_and_spanattn


def sample(name: str, tokens: list[int], suffix: int = 0) -> dict:
    """One unpadded sample; PaliGemma's last ``suffix`` tokens are its suffix (token type 1)."""
    ids = torch.tensor([tokens])
    if name.startswith("paligemma"):
        types = torch.tensor([[0] * (len(tokens) - suffix) + [1] * suffix])
    else:
        types = (ids == IMG).long()
    torch.manual_seed(len(tokens))
    return {"input_ids": ids, hm.FAMILIES[name][1]: types, **hm.images(name, hm.images_in(tokens))}


def samples(name: str) -> list[dict]:
    """Three samples; the second ends in an image and the third starts with one, so the packed
    row's token types hold one run across their boundary (a block id in Gemma 3's, one prefix
    block in PaliGemma's), which must not join them."""
    img = [IMG] * 16
    if name.startswith("paligemma"):
        return [
            sample(name, img + [2, 9, 3, 30, 31, 32], suffix=3),
            sample(name, img + [2, 9]),
            sample(name, img + [2, 10, 3, 40, 41], suffix=2),
        ]
    return [
        sample(name, [2, 9, 10] + img + [11, 12] + img + [13, 14]),
        sample(name, [2, 9] + img),
        sample(name, img + [3, 4, 12]),
    ]


def pack(name: str, parts: list[dict]) -> dict:
    """The samples in one row, position ids restarting at each (DataCollatorWithFlattening's
    layout), images in sample order."""
    row = {
        key: torch.cat([p[key] for p in parts], 1 if key in ("input_ids", hm.FAMILIES[name][1]) else 0)
        for key in parts[0]
    }
    row["position_ids"] = torch.cat([torch.arange(p["input_ids"].shape[1]) for p in parts])[None]
    return row


def summed_loss(model, kw: dict, starts: list[int]) -> torch.Tensor:
    """Next-token cross-entropy summed over the row, none across a sample start."""
    logits = model(**kw).logits[0, :-1]
    labels = kw["input_ids"][0, 1:].clone()
    labels[[s - 1 for s in starts if s > 0]] = -100
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def one_by_one(model, parts: list[dict]) -> tuple[torch.Tensor, dict]:
    """Logits of the samples run alone, concatenated, and the gradients of their summed losses."""
    model.train()
    model.zero_grad()
    outs = []
    for p in parts:
        outs.append(model(**p).logits.detach())
        summed_loss(model, p, [0]).backward()
    return torch.cat(outs, 1), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def packed(model, row: dict, starts: list[int]) -> tuple[torch.Tensor, dict]:
    model.train()
    model.zero_grad()
    logits = model(**row).logits.detach()
    summed_loss(model, row, starts).backward()
    return logits, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def starts_of(parts: list[dict]) -> list[int]:
    lens = [p["input_ids"].shape[1] for p in parts]
    return [sum(lens[:i]) for i in range(len(lens))]


@pytest.mark.parametrize("name", PACKED)
def test_packed_row_trains_like_its_samples_one_by_one(name):
    eager, ours = pair(name)
    parts = samples(name)
    row = pack(name, parts)
    want_logits, want = one_by_one(eager, parts)
    with packing_composed_last():
        got_logits, got = packed(ours, row, starts_of(parts))
    assert rel(got_logits, want_logits) < TOL
    worst = hm.gradient_error(want, got)
    assert worst[0] < TOL, worst
    if name in EAGER_PACKS:
        eager.eval()
        with torch.no_grad():
            assert rel(got_logits, eager(**row).logits) < TOL
    # the comparison means something: without the token types the logits move far more
    plain = {k: v for k, v in row.items() if k != hm.FAMILIES[name][1]}
    ours.eval()
    with torch.no_grad():
        assert rel(ours(**plain).logits, got_logits) > 100 * TOL


def test_data_collator_with_flattening_and_flash_keywords():
    """transformers' collator with FlashAttention's keywords (token types and pixels added beside
    it): the loss of the samples one by one. Keywords that disagree with the position ids, or
    given without them, are refused naming the keyword."""
    eager, ours = pair("gemma3")
    parts = samples("gemma3")
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collate([{"input_ids": p["input_ids"][0].tolist()} for p in parts])
    assert batch["cu_seq_lens_q"].tolist() == starts_of(parts) + [batch["input_ids"].shape[1]]
    row = pack("gemma3", parts)
    batch.update({k: row[k] for k in ("token_type_ids", "pixel_values")})
    ours.eval()
    eager.eval()
    with torch.no_grad(), packing_composed_last():
        total = sum(summed_loss(eager, p, [0]) for p in parts)
        assert rel(summed_loss(ours, batch, starts_of(parts)), total) < TOL
        bad = batch["cu_seq_lens_k"].clone()
        bad[1] += 1
        wrong = r"cu_seq_lens_k=\[0, 40, 57, 76\] does not match .* \(\[0, 39, 57, 76\]\)"
        with pytest.raises(ValueError, match=wrong):
            ours(**dict(batch, cu_seq_lens_k=bad))
        unpacked = {k: v for k, v in batch.items() if k != "position_ids"}
        with pytest.raises(ValueError, match="cu_seq_lens_q=.* restarting at each sample"):
            ours(**unpacked)


def test_packed_row_under_torch_compile_refused_by_name(monkeypatch):
    """A compiled forward plans one sequence per row on the device: a packed row is refused."""
    _, ours = pair("gemma4")
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    row = pack("gemma4", samples("gemma4"))
    with torch.no_grad(), pytest.raises(NotImplementedError, match="a packed row"):
        ours.eval()(**row)


@st.composite
def packed_layouts(draw, name: str):
    """2-4 samples of random text and image runs (PaliGemma: a prefix, then maybe a suffix)."""
    values, parts = BUILDERS[name][1], []
    for _ in range(draw(st.integers(2, 4))):
        if name.startswith("paligemma"):
            runs = [(0, draw(st.integers(1, 8))), (1, draw(st.integers(0, 4)))]
        else:
            run = st.tuples(st.sampled_from(values), st.integers(1, 8))
            runs = draw(st.lists(run, min_size=1, max_size=4))
        parts.append([t for t, n in runs for _ in range(n)])
    return parts, draw(st.integers(1, 9))


@pytest.mark.parametrize("name", PACKED + ["diffusion_gemma"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_packed_masks_are_each_samples_own(name, data):
    """The plans spanattn builds from a packed row's masks, as dense masks, equal transformers'
    eager masks of the samples built one by one, placed on the diagonal (nothing across)."""
    family, _, builder = BUILDERS[name]
    if not hm.available(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    parts, window = data.draw(packed_layouts(name))
    types = torch.tensor([sum(parts, [])])
    length = types.shape[1]
    positions = torch.cat([torch.arange(len(p)) for p in parts])[None]
    cfg = config(family, window, sahf.NAME)
    with packing_composed_last():
        ours = builder(cfg, torch.zeros(1, length, 16), None, None, positions, types)
    ours = ours if isinstance(ours, dict) else {"full_attention": ours}
    want = {kind: torch.zeros(length, length, dtype=torch.bool) for kind in ours}
    start, eager = 0, config(family, window, "eager")
    for p in parts:
        n, one = len(p), torch.tensor([p])
        theirs = builder(eager, torch.zeros(1, n, 16), torch.ones(1, n, dtype=torch.bool), None, None, one)
        theirs = theirs if isinstance(theirs, dict) else {"full_attention": theirs}
        for kind, mask in theirs.items():
            want[kind][start : start + n, start : start + n] = as_dense(mask, None, n)[0]
        start += n
    for kind, mask in ours.items():
        assert mask.rule.samples is not None, kind
        assert torch.equal(as_dense(None, mask, length)[0], want[kind]), (kind, parts, window)
