"""benchmarks/hf_families.py end to end at toy sizes on CPU: every timed row checked against
transformers' own attention, JSON and PNG written."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

pytest.importorskip("transformers")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("hf_families", ROOT / "benchmarks" / "hf_families.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_hf_families_tiny(tmp_path, capsys):
    script = load_script()
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3,paligemma,pi0", "--sizes", "128"]
    assert script.main(argv + ["--warmup", "0", "--repeats", "1"]) == 0
    assert "[3/3] PI0" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-hf-families-cpu.json")
    data = json.loads(path.read_text())
    assert data["gpu"] is None and data["transformers"] and data["torch"]
    assert {f: c["ok"] for f, c in data["exactness"].items()} == {
        "Gemma 3": True,
        "PaliGemma 2": True,
        "PI0": True,
    }
    ours = {r["family"]: r for r in data["results"] if r["impl"] == "spanattn"}
    assert all(
        r["status"] == "ok" and r["rel_vs_reference"] < 1e-3 and r["speedup_vs_eager"] > 0
        for r in ours.values()
    )
    assert (
        ours["Gemma 3"]["images"] >= 1 and ours["PaliGemma 2"]["reference"] == "eager"
    )  # SDPA has no softcap
    assert path.with_suffix(".png").exists()
