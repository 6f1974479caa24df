"""benchmarks/short_walks.py end to end on CPU at toy size: the triton backend checked against
fp64 before it is timed, the JSON written (efficiencies need FA4 and a GPU)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_short_walks_small(tmp_path):
    spec = importlib.util.spec_from_file_location("short_walks", ROOT / "benchmarks" / "short_walks.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script
    spec.loader.exec_module(script)
    argv = ["--out", str(tmp_path), "--scenarios", "S4", "--scale", "64", "--rounds", "2", "--reps", "1"]
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("*-short-walks-cpu.json")
    data = json.loads(path.read_text())
    (row,) = data["rows"]
    assert (row["scenario"], row["d"]) == ("S4", 128) and row["allowed_pairs"] > 0
    triton = row["contenders"]["triton"]
    assert triton["check"]["ok"] and len(triton["rounds_ms"]) == 2 and triton["tflops"] > 0
