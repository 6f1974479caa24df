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


def block_mask_models() -> list[type]:
    """Model classes of the modeling files that compose image blocks into their masks
    (``block_sequence_ids``) or say they turn flash attention off for bidirectional masks."""
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
                and getattr(cls, "config_class", None) is not None
            ):
                found.append(cls)
    return found


def test_every_flash_off_family_is_served_or_refused_by_name():
    models = block_mask_models()
    served, refused = set(), set()
    for cls in (m for m in models if not m._supports_flash_attn):
        family = sahf.family_of(cls.config_class)
        if family is not None:
            served.add(family.name)
            continue
        with pytest.raises(NotImplementedError, match=rf"{cls.__name__} \(model_type "):
            stack_configs(cls, cls.config_class)
        refused.add(cls.__name__)
    assert refused, "the walk should also meet families spanattn does not serve"
    # The scan sees every family spanattn serves that this transformers has (releases before
    # 5.24 left their flash path on, dropping the blocks: then they are not in `served`).
    scanned = {f.name for m in models if (f := sahf.family_of(m.config_class))}
    present = {f.name for f in sahf.FAMILIES if any(hasattr(transformers, c) for c in f.stacks)}
    assert scanned == present and served <= present, (scanned, served, present)
