"""tools/kernel_lab/short_walks_calls.py on hand-made calls: each call's verdict names exactly the
steps that miss a target, the best contender is any that has an efficiency, and the script runs
end to end on JSON files."""

from __future__ import annotations

import json

import pytest
from bench_scripts import LAB, load_script

TARGETS = {"triton": 0.95, "best": 1.0}


def _row(sid, d, **effs):
    names = {"per_item": "triton, one program per item"}
    contenders = {names.get(n, n): {"ms": 1.0, "tflops": 500.0, "efficiency": e} for n, e in effs.items()}
    return {"scenario": sid, "d": d, "contenders": contenders}


def _d512(tflops):
    return {"scenario": "S5", "d": 512, "contenders": {"triton": {"ms": 38.0, "tflops": tflops}}}


def _call(rows, date="2026-12-06T05:00:00+00:00"):
    return {"gpu": "NVIDIA H200", "date": date, "targets": TARGETS, "rows": rows}


def test_verdict_names_the_steps_that_miss_each_target():
    mod = load_script("short_walks_calls", LAB)
    call = _call([
        _row("S0", 128, triton=0.998, fa4=1.003),  # best met by fa4
        _row("S2", 128, triton=0.991, fa4=0.987),  # best missed
        _row("S3", 256, triton=0.94, fa4=0.5),  # both missed
        _d512(449.6),
    ])  # fmt: skip
    assert mod.verdict(call) == {
        "triton >= 0.95": ["S3 d256 0.940"],
        "best >= 1.0": ["S2 d128 0.991", "S3 d256 0.940"],
        "d512 >= 450 TFLOP/s": ["S5 d512 449.6"],
    }
    assert mod.verdict(_call([_row("S1", 128, triton=1.06), _d512(455.0)])) == {
        "triton >= 0.95": [], "best >= 1.0": [], "d512 >= 450 TFLOP/s": [],
    }  # fmt: skip


def test_best_counts_every_launch_and_a_step_without_efficiency_misses():
    mod = load_script("short_walks_calls", LAB)
    row = _row("S0", 128, triton=0.99, per_item=1.02, fa4=1.0)
    assert mod.best(row) == ("triton, one program per item", 1.02)
    bare = {"scenario": "S4", "d": 128, "contenders": {"triton": {"ms": 0.4, "tflops": 600.0}}}
    assert mod.best(bare) is None
    assert mod.verdict(_call([bare]))["best >= 1.0"] == ["S4 d128 0.000"]


def test_end_to_end_on_two_calls(tmp_path, capsys):
    mod = load_script("short_walks_calls", LAB)
    paths = []
    for i, (eff, rate) in enumerate([(1.01, 455.0), (0.99, 451.0)]):
        p = tmp_path / f"call{i}.json"
        p.write_text(json.dumps(_call([_row("S0", 256, triton=eff, fa4=0.98), _d512(rate)])))
        paths.append(str(p))
    assert mod.main([*paths, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "S0 d256: triton 1.010 / 0.990 | best 1.010 (triton) / 0.990 (triton)" in out
    assert "S5 d512: triton 455 / 451 TFLOP/s" in out
    assert "call 1 (NVIDIA H200, 2026-12-06T05:00:00+00:00): triton >= 0.95: met; best >= 1.0: met" in out
    assert "call 2 " in out and "best >= 1.0: missed on S0 d256 0.990" in out
    if mod.pyplot() is not None:
        assert (tmp_path / "out" / "call0-calls.png").stat().st_size > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        mod.main([str(bad), "--out", str(tmp_path)])
    assert "calls: every JSON must be short_walks.py's" in capsys.readouterr().err
