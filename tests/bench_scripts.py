"""The benchmark scripts (benchmarks/*.py) and the kernel lab's (tools/kernel_lab/*.py), scripts
rather than a package, loaded as modules for their CPU tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


LAB = "tools/kernel_lab"


def load_script(name: str, folder: str = "benchmarks"):
    """``<folder>/<name>.py`` as module ``name``, registered in ``sys.modules`` (a script's
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
