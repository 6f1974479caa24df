"""benchmarks/short_walks.py end to end on CPU at toy size: the triton backend checked against
fp64 before it is timed, the JSON written (efficiencies need FA4 and a GPU)."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script


def test_short_walks_small(tmp_path):
    script = load_script("short_walks")
    argv = ["--out", str(tmp_path), "--scenarios", "S4", "--scale", "64", "--rounds", "2", "--reps", "1"]
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("*-short-walks-cpu.json")
    data = json.loads(path.read_text())
    (row,) = data["rows"]
    assert (row["scenario"], row["d"]) == ("S4", 128) and row["allowed_pairs"] > 0
    triton = row["contenders"]["triton"]
    assert triton["check"]["ok"] and len(triton["rounds_ms"]) == 2 and triton["tflops"] > 0


def test_a_scenario_picked_by_head_dim_and_an_unknown_one_refused(tmp_path, capsys):
    script = load_script("short_walks")
    argv = ["--out", str(tmp_path), "--scale", "64", "--rounds", "1", "--reps", "1"]
    assert script.main([*argv, "--scenarios", "S1-256"]) == 0
    (path,) = tmp_path.glob("*-short-walks-cpu.json")
    assert [(r["scenario"], r["d"]) for r in json.loads(path.read_text())["rows"]] == [("S1", 256)]
    with pytest.raises(SystemExit):
        script.main([*argv, "--scenarios", "S1-64"])
    assert "--scenarios: S1-64 not among" in capsys.readouterr().err
