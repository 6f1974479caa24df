"""`spanattn bench` end to end at a tiny size on CPU: rows checked and timed, JSON and PNG."""

from __future__ import annotations

import argparse
import json

import pytest

from spanattn import bench


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_bench_writes_json_and_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--scenarios",
            "S1,S4",
            "--head-dims",
            "32",
            "--scale",
            "64",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ]
        + ["--backends", "flex,sdpa,flex+create_block_mask,sdpa-flash-causal"]
    )
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "SMALL versions" in printed and "[8/8]" in printed
    (js,) = tmp_path.glob("bench-cpu-*.json")
    assert list(tmp_path.glob("bench-cpu-*.png"))
    data = json.loads(js.read_text())
    assert data["gpu"] is None and data["scale"] == 64 and "torch" in data
    ok = {(r["scenario"], r["backend"]) for r in data["rows"] if r["status"] == "ok"}
    assert {("S1", "flex"), ("S4", "flex"), ("S1", "flex+create_block_mask"), ("S4", "sdpa")} <= ok
    flex = next(r for r in data["rows"] if r["backend"] == "flex" and r["scenario"] == "S1")
    assert flex["check"]["ok"] and flex["ms"] > 0 and flex["plan_ms"] > 0 and flex["vs_best_peer"] > 0
    skipped = next(r for r in data["rows"] if r["backend"] == "sdpa-flash-causal" and r["scenario"] == "S1")
    assert skipped["status"] == "skipped" and "causal" in skipped["reason"]


def test_ratios_keep_the_speed_of_light_apart():
    """A peer computing a simpler mask (FA4's built-in causal on a layer with spans) is not the
    best peer to beat; it is the speed of light, reported in its own column."""
    from spanattn.bench.report import add_ratios, table

    row = lambda name, kind, ms, exact=True: dict(
        scenario="S1", d=128, backend=name, kind=kind, ms=ms, tflops=1.0, status="ok", exact_mask=exact
    )
    rows = [row("fa4", "spanattn", 0.8), row("flex+cbm", "peer", 1.2), row("fa4-builtin", "peer", 0.6, False)]
    add_ratios(rows)
    ours = rows[0]
    assert ours["vs_best_peer"] == 1.5 and ours["vs_speed_of_light"] == 0.75
    assert "1.50x" in table(rows).splitlines()[2] and "0.75x" in table(rows).splitlines()[2]
