"""transformers integration: a model's text attention computed by spanattn, no dense mask built.

    import spanattn.hf                       # registers attn_implementation="spanattn"
    model = Gemma3ForConditionalGeneration.from_pretrained(path, attn_implementation="spanattn")
    spanattn.hf.enable(model, backend="triton")   # or: a model already loaded; options

Families: Gemma 3, Gemma 4, Gemma 4 unified, DiffusionGemma, PaliGemma (1 and 2), Molmo2 (every
image and video frame of a row one span group), PI0, and causal decoders that transformers lets run
flash attention. Each layer kind's policy is read from the mask the model's own code builds
(:mod:`spanattn.hf.mask_functions`), its spans from the block ids that code computes.

How it plugs in (transformers >= 5):
- ``AttentionMaskInterface``: mask creation returns a :class:`StepMask` (policy, 2D padding mask,
  KV offsets, spans: O(batch x tokens)) instead of an O(q x kv) tensor, once per forward and
  layer kind, so the Plan cached on it is shared by every layer of that kind.
- ``AttentionInterface``: packs ``[B, H, S, D]`` into varlen ``[tokens, H, D]`` (padding dropped)
  and calls :func:`spanattn.attention`. Encoder layers (vision and audio towers: bidirectional
  over their own inputs, no cache) keep transformers' SDPA.

Supported: forward passes, ``generate()`` with a DynamicCache or a StaticCache, transformers'
compiled generation (torch.compile over a StaticCache: :mod:`spanattn.hf.static`), chunked
prefill (token types of the whole prompt with each chunk), left padding (rows ``0..0 1..1``), right
padding (``1..1 0..0``, ``0..0 1..1 0..0``) in forwards without cache history (training, a prefill
from position 0), training (gradients through every backend), padding-free packed rows (position ids
restarting per sample: one spanattn sequence per sample, its images from its own token types:
:mod:`spanattn.hf.packing`). Raised: padding between real tokens,
right padding where a cache is read or filled, attention dropout, prepared 4D masks, masks spanattn
has no policy for (named in the error).
"""

from __future__ import annotations

from .attention import attention_forward
from .families import FAMILIES, disable, enable, family_of
from .options import NAME
from .step import StepMask, step_mask

__all__ = [
    "FAMILIES",
    "NAME",
    "StepMask",
    "attention_forward",
    "disable",
    "enable",
    "family_of",
    "register",
    "step_mask",
]


def register() -> None:
    """Register ``attn_implementation="spanattn"`` with transformers (idempotent; done at import).
    Here, above the modules it registers: families.py, which step.py imports, must not import them."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, step_mask)


register()
