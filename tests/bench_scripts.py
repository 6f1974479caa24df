"""The benchmark scripts (benchmarks/*.py: scripts, not a package) loaded as modules, for their
CPU tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``benchmarks/<name>.py`` as module ``name``, registered in ``sys.modules`` (a script's
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
