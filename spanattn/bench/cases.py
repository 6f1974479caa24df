"""Case names of the scripts that time or inspect one kernel step at a time (tools/kernel_lab/:
ab_trees.py, deal_balance.py, profile_kernels.py): ``SCENARIO-HEAD_DIM[-pPAGE]``."""

from __future__ import annotations

import re

from spanattn.scenarios import Scenario, scenarios, video_scenarios


def named_scenarios(scale: int = 1) -> dict[str, Scenario]:
    """The standard scenarios and the span-group video steps, by id."""
    return {**scenarios(scale), **video_scenarios(scale)}


def parse_case(case: str, pages: bool = True) -> tuple[str, int, int]:
    """``S3-256`` -> ("S3", 256, 0): scenario, head_dim, page size (0: packed K/V);
    ``S1-128-p16`` -> ("S1", 128, 16): K/V in a cache of 16-token pages (refused without ``pages``).

    >>> parse_case("V2-128")
    ('V2', 128, 0)
    """
    m = re.fullmatch(r"(\w+)-(\d+)(?:-p(\d+))?", case)
    if not m or m[1] not in named_scenarios() or (m[3] and not pages):
        form = (
            "SCENARIO-HEAD_DIM[-pPAGE] (e.g. S3-256, S1-128-p16)"
            if pages
            else "SCENARIO-HEAD_DIM (e.g. S3-256)"
        )
        raise ValueError(f"--cases: {case!r} is not {form}")
    return m[1], int(m[2]), int(m[3] or 0)


def packed_cases(ap, text: str) -> dict[str, tuple[str, int]]:
    """A script's ``--cases`` over packed K/V (``S3-256,S4-128``): case -> (scenario, head_dim);
    a malformed case ends the run with ``ap``'s error naming it."""
    try:
        return {case: parse_case(case, pages=False)[:2] for case in text.split(",")}
    except ValueError as e:
        ap.error(str(e))
