"""benchmarks/auto_choice.py on CPU at toy size: each fast backend checked before it is timed or
said to be unable to run, auto's pick recorded, an unknown case refused."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load_script


def _script():
    load_script("short_walks")  # what auto_choice.py imports from its own folder
    return load_script("auto_choice")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run: a GPU times full-size steps")
def test_auto_choice_small(tmp_path):
    script = _script()
    argv = ["--out", str(tmp_path), "--cases", "S4-128", "--rounds", "1", "--reps", "1"]
    assert script.main(argv) == 0
    (path,) = tmp_path.glob("*-auto-choice-cpu.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["case"] == "S4-128" and row["auto"] in ("sdpa", "reference")  # auto never interprets
    triton, fa4 = row["backends"]["triton"], row["backends"]["fa4"]
    assert triton["check"]["ok"] and len(triton["blocks_rounds_ms"]) == len(triton["turns_rounds_ms"]) == 1
    assert fa4 == {"status": "cannot run this step"}


def test_an_unknown_case_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path), "--cases", "S3-256"])
    assert "--cases: S3-256 not among" in capsys.readouterr().err
