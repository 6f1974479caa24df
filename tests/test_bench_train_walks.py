"""benchmarks/train_walks.py end to end on CPU at toy size: the dense backends checked against
the fp64 truth before they are timed, bit-equal repeats, the JSON written (triton interpreted is
too slow for it; efficiencies and peak memory need a GPU)."""

from __future__ import annotations

import json

from bench_scripts import load_script


def test_train_walks_small(tmp_path):
    load_script("short_walks")  # what the script imports from its folder
    script = load_script("train_walks")
    argv = ["--out", str(tmp_path), "--cases", "T3-128", "--scale", "64", "--rounds", "1", "--reps", "1",
            "--contenders", "sdpa,reference"]  # fmt: skip
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("*-train-walks-cpu.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["scenario"], row["d"]) == ("T3", 128) and row["allowed_pairs"] > 0
    assert set(row["contenders"]) == {"sdpa", "reference"}
    for name in ("sdpa", "reference"):
        c = row["contenders"][name]
        assert c["check"]["ok"] and c["deterministic"], name
        assert c["bwd_tflops"] > 0 and c["fwd_bwd_tflops"] > 0, name
        assert c["check"]["dq"]["err"] <= c["check"]["dq"]["bound"]
