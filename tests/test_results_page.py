"""The results page and the folders it describes: benchmarks/README.md stays under 250 lines,
names every script left in benchmarks/ (each reproduces one of its tables), and the kernel lab's
README every instrument; every relative link of the project's Markdown files resolves to a file
of the repository (a result's JSON, a script, a section's page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         ROOT / "tools" / "kernel_lab" / "README.md"]  # fmt: skip


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text: inline ``](target)`` and ``[ref]: target``."""
    inline = re.findall(r"\]\(([^)\s]+)\)", text)
    defined = re.findall(r"^\[[\w-]+\]: (\S+)$", text, re.M)
    return [t.split("#")[0] for t in inline + defined if not re.match(r"[a-z]+://", t) and t.split("#")[0]]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = [t for t in links(page.read_text()) if not (page.parent / t).exists()]
    assert not broken, broken


def test_results_page_is_short_and_names_every_script():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert len(text.splitlines()) < 250
    assert len(links(text)) > 50  # every number links its run's JSON
    unnamed = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in text]
    assert not unnamed, f"scripts in benchmarks/ that reproduce no table of its README: {unnamed}"


def test_kernel_lab_readme_names_every_instrument():
    text = (ROOT / "tools" / "kernel_lab" / "README.md").read_text()
    unnamed = [p.name for p in (ROOT / "tools" / "kernel_lab").glob("*.py") if f"`{p.name}`" not in text]
    assert not unnamed, unnamed
