"""Per-stack options (backend, allow_split_spans), kept beside the configs they belong to.

A model loaded with ``attn_implementation="spanattn"`` runs with the defaults; :func:`spanattn.hf.enable`
sets them for the text configs of one model. transformers configs are not hashable, so they are
keyed by identity and forgotten when the config is collected.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

NAME = "spanattn"


@dataclass(frozen=True)
class Options:
    """backend: passed to :func:`spanattn.attention`. allow_split_spans: a forward whose last key
    falls inside an image proceeds with the image cut there (transformers' behaviour)."""

    backend: str = "auto"
    allow_split_spans: bool = False


_BY_CONFIG: dict[int, tuple[weakref.ref, Options]] = {}


def set_options(config, options: Options | None) -> None:
    """Options for the layers of ``config`` (``None``: back to the defaults)."""
    key = id(config)
    _BY_CONFIG.pop(key, None)
    if options is not None:

        def forget(ref):  # unless the id was taken by a newer config meanwhile
            if _BY_CONFIG.get(key, (None,))[0] is ref:
                del _BY_CONFIG[key]

        _BY_CONFIG[key] = (weakref.ref(config, forget), options)


def options_of(config) -> Options:
    """The options :func:`set_options` gave ``config``, else the defaults."""
    entry = _BY_CONFIG.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else Options()
