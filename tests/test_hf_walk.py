"""Every model of the installed transformers whose flash-attention path is off because its masks
have bidirectional blocks is either a family spanattn.hf serves or refused by name: none may be
accepted by enable() and fail (or run wrong) later."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

import spanattn.hf as sahf
from spanattn.hf.families import stack_configs

transformers = pytest.importorskip("transformers")


def flash_off_for_bidirectional_masks() -> list[type]:
    """Model classes with flash attention off, from the modeling files that compose image blocks
    into their masks (``block_sequence_ids``) or say they turn flash off for bidirectional masks."""
    from transformers import PreTrainedModel

    root = pathlib.Path(transformers.models.__file__).parent
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        source = path.read_text()
        flagged = re.search(r"_supports_flash_attn = False\s*#[^\n]*bidirectional", source)
        if "block_sequence_ids" not in source and not flagged:
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and issubclass(cls, PreTrainedModel)
                and cls.__module__ == module.__name__
                and not cls._supports_flash_attn
                and getattr(cls, "config_class", None) is not None
            ):
                found.append(cls)
    return found


def test_every_flash_off_family_is_served_or_refused_by_name():
    served, refused = set(), set()
    for cls in flash_off_for_bidirectional_masks():
        family = sahf.family_of(cls.config_class)
        if family is not None:
            served.add(family.name)
            continue
        with pytest.raises(NotImplementedError, match=rf"{cls.__name__} \(model_type "):
            stack_configs(cls, cls.config_class)
        refused.add(cls.__name__)
    present = {f.name for f in sahf.FAMILIES if any(_module_exists(c) for c in f.stacks)}
    assert served == present, f"families found by the walk: {served}, known: {present}"
    assert refused, "the walk should also meet families spanattn does not serve"


def _module_exists(config_class_name: str) -> bool:
    return hasattr(transformers, config_class_name)
