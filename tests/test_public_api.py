"""The public surface: a handful of names, each documented and annotated, the plumbing of the
plans out of sight, the package typed (PEP 561), and ``auto_choice`` naming what auto runs."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import spanattn as sa

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {
    "Batch", "DevicePlan", "DevicePlanner", "LayerMask", "Plan", "Seq", "attention", "auto_choice",
    "check_pending_pages", "drop_wide_spans", "max_chunk_end", "merge_attention_states", "plan",
    "spans_from_placeholders", "spans_from_token_types", "write_kv_cache",
}  # fmt: skip


def test_all_is_the_public_surface():
    assert set(sa.__all__) == PUBLIC
    for name in PUBLIC:
        assert inspect.getdoc(getattr(sa, name)), name


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if inspect.isfunction(getattr(sa, n))))
def test_public_functions_are_annotated(name):
    sig = inspect.signature(getattr(sa, name))
    missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not missing, f"{name}: parameters without annotations {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"


def test_plan_plumbing_is_private():
    hidden = {sa.Plan: ("from_handle", "facts"), sa.DevicePlan: ("from_op", "refresh", "facts")}
    for cls, plumbing in hidden.items():
        public = {n for n in dir(cls) if not n.startswith("_")}
        assert not public & set(plumbing), cls
        for n in public:
            member = inspect.getattr_static(cls, n)
            if callable(member) and not isinstance(member, type):
                assert inspect.getdoc(getattr(cls, n)), f"{cls.__name__}.{n} has no docstring"


def test_package_is_typed():
    assert (ROOT / "spanattn" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is Python 3.11+
    assert '[tool.setuptools.package-data]\nspanattn = ["py.typed"]' in pyproject


def test_auto_choice_names_the_backend_auto_runs():
    batch = sa.Batch([sa.Seq(q_len=8, spans=[(2, 5)]), sa.Seq(q_len=1, kv_len=4)])
    p = sa.plan(batch, sa.LayerMask(window=4))
    q, k = torch.randn(p.total_q, 2, 16), torch.randn(p.total_k, 1, 16)
    assert sa.auto_choice(q, p) == "sdpa"
    assert sa.auto_choice(q, p, softcap=30.0) == "reference"  # SDPA has no softcap
    ran = sa.attention(q, k, k, p, softcap=30.0)
    assert torch.equal(ran, sa.attention(q, k, k, p, softcap=30.0, backend="reference"))
