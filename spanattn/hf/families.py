"""The transformers families spanattn.hf knows, which of their sub-configs it runs, and
:func:`enable` / :func:`disable` for models already loaded.

A family is recognised by its exact config class, never by a model-type prefix. Its layer
policies are not listed here: :mod:`spanattn.hf.mask_functions` reads them from the masks the
family's own code builds, so every code path (forward, generate, static cache) gets the policy
transformers gives it. What a family entry adds is which stacks are text (towers keep their own
attention) and the configs spanattn refuses by name. A model outside these families is run only
if transformers lets it use flash attention (its masks are causal with a sliding window, what
flash attention computes); any other is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .options import NAME, Options, set_options


def _bidirectional_text(config) -> str | None:
    mode = getattr(config.get_text_config(), "use_bidirectional_attention", None)
    if mode in (True, "all"):
        return f"use_bidirectional_attention={mode!r} makes every text layer bidirectional (an encoder)"
    return None


def _gemma_backbone(*paths: str) -> Callable:
    """Refuses text backbones other than Gemma and Gemma 2 (those spanattn's tests cover)."""

    def refuse(config) -> str | None:
        for path in paths:
            name = type(sub_config(config, path)).__name__
            if name not in ("GemmaConfig", "Gemma2Config"):
                return f"{path} is a {name}; spanattn.hf knows Gemma and Gemma 2 backbones here"
        return None

    return refuse


@dataclass(frozen=True)
class Family:
    """name; stacks: config class name -> dotted paths of the sub-configs whose layers spanattn
    runs ("" is the config itself); refuse: a reason this config is not served, or None."""

    name: str
    stacks: dict
    refuse: Callable = lambda config: None


FAMILIES = (
    Family("Gemma 3", {"Gemma3Config": ("text_config",), "Gemma3TextConfig": ("",)}, _bidirectional_text),
    Family("Gemma 4", {"Gemma4Config": ("text_config",), "Gemma4TextConfig": ("",)}, _bidirectional_text),
    Family(
        "Gemma 4 unified",
        {"Gemma4UnifiedConfig": ("text_config",), "Gemma4UnifiedTextConfig": ("",)},
        _bidirectional_text,
    ),
    Family(
        "DiffusionGemma",
        {"DiffusionGemmaConfig": ("text_config",), "DiffusionGemmaTextConfig": ("",)},
        _bidirectional_text,
    ),
    Family("PaliGemma", {"PaliGemmaConfig": ("text_config",)}, _gemma_backbone("text_config")),
    Family("Molmo2", {"Molmo2Config": ("text_config",), "Molmo2TextConfig": ("",)}),
    Family(
        "PI0",
        {"PI0Config": ("vlm_config.text_config", "dit_config")},
        _gemma_backbone("vlm_config.text_config", "dit_config"),
    ),
)


def sub_config(config, path: str):
    for part in filter(None, path.split(".")):
        config = getattr(config, part)
    return config


def family_of(config) -> Family | None:
    """The known family of a config (instance or class), by its exact class name."""
    name = config.__name__ if isinstance(config, type) else type(config).__name__
    return next((f for f in FAMILIES if name in f.stacks), None)


def stack_configs(model_class: type, config) -> list:
    """The configs of ``model_class`` (with ``config``) whose layers spanattn runs; raises
    ``NotImplementedError`` naming the family when spanattn does not serve it."""
    family = family_of(config)
    if family is not None:
        why = family.refuse(config)
        if why:
            raise NotImplementedError(f"spanattn.hf does not serve this {family.name} model: {why}")
        return [sub_config(config, path) for path in family.stacks[type(config).__name__]]
    if getattr(model_class, "_supports_flash_attn", False):
        text = config.get_text_config()
        if getattr(text, "is_causal", True) and (
            text is not config or not getattr(config, "sub_configs", {})
        ):
            return [text]
    known = ", ".join(f.name for f in FAMILIES)
    raise NotImplementedError(
        f"spanattn.hf does not know the attention masks of {model_class.__name__} (model_type "
        f"{getattr(config, 'model_type', '?')!r}): it serves {known}, and causal decoders that "
        "transformers lets run flash attention"
    )


def enable(model, *, backend: str = "auto", allow_split_spans: bool = False):
    """Run ``model``'s text attention through spanattn; vision and audio towers keep theirs.

    backend: passed to :func:`spanattn.attention` (``"auto"``: the fastest that runs the call).
    allow_split_spans: a forward whose last key falls inside an image proceeds with the image
        cut there (transformers' behaviour) instead of raising.
    Calling it again replaces the options; :func:`disable` undoes it. Returns the model.
    (``attn_implementation="spanattn"`` is registered when spanattn.hf is imported, which
    importing this module does first.)
    """
    configs = stack_configs(type(model), model.config)
    disable(model)
    # The model's own config too, without its towers: some code hands it to the mask interface
    # (DiffusionGemma's decoder mask in generate()).
    top = [model.config] if all(c is not model.config for c in configs) else []
    model._spanattn_previous = [(c, c._attn_implementation_internal) for c in configs + top]
    for config in configs + top:
        set_options(config, Options(backend, allow_split_spans))
        config._attn_implementation_internal = NAME
    return model


def disable(model):
    """Undo :func:`enable`: the previous attention implementations back."""
    for config, previous in model.__dict__.pop("_spanattn_previous", ()):
        set_options(config, None)
        config._attn_implementation_internal = previous
    return model
