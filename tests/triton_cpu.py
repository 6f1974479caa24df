"""A spanattn module with Triton kernels, for tests that run on a GPU or, without one, in Triton's
interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1 before triton loads)."""

import importlib
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def load(name: str, kernel: str):
    """``spanattn.<name>``, reloaded if it was imported before the interpreter was switched on
    (its ``kernel`` then is not an interpreted function); skips the calling test module when
    there is neither a GPU nor the interpreter."""
    pytest.importorskip("triton")
    module = importlib.import_module(f"spanattn.{name}")
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)
    if DEV == "cpu" and type(getattr(module, kernel)).__name__ != "InterpretedFunction":
        module = importlib.reload(module)
    return module
