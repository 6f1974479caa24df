"""benchmarks/gpu_groups.py end to end at toy sizes on CPU: the video steps with and without
span groups checked against fp64 before timing, the summary's ratios, JSON and PNG written."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_gpu_groups_small(tmp_path, capsys):
    script = load_script("gpu_groups")
    argv = [
        "--out",
        str(tmp_path),
        "--scale",
        "128",
        "--no-grid",
        "--backends",
        "sdpa,flex+create_block_mask",
    ]
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("*-groups-cpu.json")
    data = json.loads(path.read_text())
    assert data["gpu"] is None and data["torch"] and "transformers" in data and data["scale"] == 128
    rows = {(r["scenario"], r["backend"]): r for r in data["rows"]}
    assert set(rows) == {
        (s, b) for s in ("V1", "V1-plain", "V2", "V2-plain") for b in ("sdpa", "flex+create_block_mask")
    }
    assert all(r["status"] == "ok" and r["check"]["ok"] for r in rows.values())
    # the grouped step allows more pairs than its twin: the frames see each other
    assert rows["V1", "sdpa"]["allowed_pairs"] > rows["V1-plain", "sdpa"]["allowed_pairs"]
    (v1,) = [s for s in data["summary"] if s["scenario"] == "V1" and s["backend"] == "sdpa"]
    assert v1["vs_flex_create_block_mask"] > 0 and v1["per_pair_vs_without_groups"] > 0
    assert path.with_suffix(".png").exists() and "summary" in capsys.readouterr().out


def test_group_planning_small(tmp_path):
    """benchmarks/group_planning.py on CPU at 1/32 size: every piece timed, the launches held
    equal to their definitions, the JSON written."""
    script = load_script("group_planning")
    assert script.main(["--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-group-planning-cpu.json")
    rows = {r["scenario"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"V1", "V1-plain", "V2", "V2-plain"}
    assert all(rows[s]["key_tile_groups_launch_ms"] > 0 for s in ("V1", "V2"))
    assert "span_groups_ms" not in rows["V1-plain"]
