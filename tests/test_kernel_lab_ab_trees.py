"""tools/kernel_lab/ab_trees.py's CPU-checkable parts: the per-case summary over rounds, and its
refusal of a run it cannot do (the timing itself needs CUDA)."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import LAB, load_script


def _script():
    return load_script("ab_trees", LAB)


def test_summary_medians_over_rounds_and_ratios_to_the_first_tree():
    rounds = [
        {"old": {"S3-256": 0.60, "S0-256": 14.0}, "new": {"S3-256": 0.58, "S0-256": 13.0}},
        {"old": {"S3-256": 0.64, "S0-256": 14.2}, "new": {"S3-256": 0.57, "S0-256": 13.4}},
        {"old": {"S3-256": 0.62, "S0-256": 13.8}, "new": {"S3-256": 0.59, "S0-256": 13.2}},
    ]
    got = _script().summary(rounds, ["old", "new"], ["S3-256", "S0-256"])
    assert got["S3-256"]["ms"] == {"old": 0.62, "new": 0.58}
    assert got["S0-256"]["ms"] == {"old": 14.0, "new": 13.2}
    assert got["S0-256"]["vs_first"] == {"old": 1.0, "new": 13.2 / 14.0}


def test_needs_two_trees(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["ab_trees.py", "--out", str(tmp_path), "--trees", "only=."])
    with pytest.raises(SystemExit):
        _script().main()


def test_a_bad_case_is_refused_before_any_timing(monkeypatch, tmp_path, capsys):
    argv = ["ab_trees.py", "--out", str(tmp_path), "--trees", "a=.", "b=.", "--cases", "S3-256,S3-x"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        _script().main()
    assert "'S3-x' is not SCENARIO-HEAD_DIM" in capsys.readouterr().err


def test_every_tree_runs_first_in_turn():
    order = _script().round_order
    firsts = [order(["a", "b", "c"], r)[0] for r in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(order(["a", "b", "c"], 2)) == ["a", "b", "c"]
