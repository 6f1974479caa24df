"""The examples run end to end on CPU and check themselves (examples/paged_engine.py compares
every output row with the host plan of the same step)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_paged_engine(compile_backend, capsys):
    engine = _load("paged_engine")
    torch._dynamo.reset()
    steps, worst = engine.run("cpu", "reference", compile_backend=compile_backend)
    out = capsys.readouterr().out
    assert steps >= 8 and worst <= 1e-5
    assert "decode" in out and "r2:24" in out  # prefill chunks and decode rows both ran
