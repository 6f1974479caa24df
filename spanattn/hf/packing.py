"""Packed rows' flash-style keywords, held to the samples read from transformers' mask.

A padding-free batch (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free``)
holds several samples in one row. spanattn reads the samples from the mask transformers
composes from the position ids (:mod:`spanattn.hf.mask_functions`: one spanattn sequence per
sample, each with its own images); the collator may also pass FlashAttention's keywords
``cu_seq_lens_q/k`` (cumulative sample lengths over the flattened tokens) and ``max_length_q/k``.
Attention does not need them, but a mask and keywords that disagree (position ids that do not
restart where ``cu_seq_lens`` says a sample starts) mean the model's positions and the caller's
samples differ: refused, naming the keyword, rather than trusting either.
"""

from __future__ import annotations

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def expected(rows, tokens: int) -> dict | None:
    """The flash keywords that describe ``rows`` (:class:`~spanattn.hf.step.Row`), or None when
    the rows do not tile all ``tokens`` (padding: flash keywords describe padding-free rows)."""
    q = [r.q1 - r.q0 for r in rows]
    k = [r.k1 - r.k0 for r in rows]
    if sum(q) != tokens:
        return None
    cumulative = lambda lens: [sum(lens[:i]) for i in range(len(lens) + 1)]
    return {
        "cu_seq_lens_q": cumulative(q),
        "cu_seq_lens_k": cumulative(k),
        "max_length_q": max(q),
        "max_length_k": max(k),
    }


def check_flash_kwargs(step, rows, tokens: int, kwargs: dict) -> None:
    """Raises ``ValueError`` when a flash keyword in ``kwargs`` disagrees with ``rows``; each
    tensor is read to the host once per step (the step's layers share it)."""
    given = [(name, kwargs[name]) for name in FLASH_KWARGS if kwargs.get(name) is not None]
    given = [(name, value) for name, value in given if (name, id(value)) not in step.flash_checked]
    if not given:
        return
    want = expected(rows, tokens)
    for name, value in given:
        got = value.tolist() if hasattr(value, "tolist") else value
        if want is None:
            raise ValueError(
                f"spanattn.hf: {name} describes padding-free rows, but this step has padding "
                "(attention_mask zeros); pass one or the other"
            )
        if got != want[name]:
            raise ValueError(
                f"spanattn.hf: {name}={got} does not match the samples of transformers' mask ({want[name]}), "
                "which it reads from position_ids restarting at each sample (DataCollatorWithFlattening "
                "gives both): pass the position_ids that go with it"
            )
        step.flash_checked.add((name, id(value)))
