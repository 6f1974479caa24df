"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh namespace.

A block whose first line is ``# needs: cuda`` runs only where a GPU is; ``# needs: download``
(weights or data from the network) never runs here. Any other first line runs everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NEEDS = {"cuda": torch.cuda.is_available, "download": lambda: False}


def blocks() -> list:
    """``pytest.param(source, where)`` of every python block, named ``file:line``."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 2}"
            found.append(pytest.param(m.group(1), where, id=where))
    return found


def needs(source: str) -> str | None:
    """What the block needs (``# needs: X`` on its first line), or None."""
    first = source.splitlines()[0] if source.strip() else ""
    m = re.fullmatch(r"#\s*needs:\s*(\w+)\s*", first)
    if m and m.group(1) not in NEEDS:
        raise ValueError(f"unknown '# needs:' marker {m.group(1)!r}; known: {sorted(NEEDS)}")
    return m.group(1) if m else None


@pytest.mark.parametrize("source, where", blocks())
def test_block_runs(source, where):
    need = needs(source)
    if need is not None and not NEEDS[need]():
        pytest.skip(f"{where} needs {need}")
    exec(compile(source, where, "exec"), {"__name__": "__docs__"})


def test_blocks_are_found_and_marked():
    found = blocks()
    assert len(found) >= 8
    assert any(needs(p.values[0]) == "cuda" for p in found)
    with pytest.raises(ValueError, match="unknown"):
        needs("# needs: tpu\nimport torch")
