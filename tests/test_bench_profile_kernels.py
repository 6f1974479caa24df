"""benchmarks/profile_kernels.py's CPU-checkable parts: reading ncu's raw counter page, and its
refusal of cases it cannot profile (the profiling itself needs a GPU and ncu)."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import load_script

RAW = (
    '"Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum","smsp__pcsamp_sample_count",'
    '"smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_wait_not_issued",'
    '"smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_sleeping",'
    '"dram__bytes_read.sum"\n'
    '"","us","inst","","warp","warp","warp","warp","Mbyte"\n'
    '"attn_fwd_gluon","1,250","3,625,317","1,000","250","100","600","0","537.5"\n'
)


def test_counters_are_read_per_kernel_with_stall_shares_largest_first():
    (row,) = load_script("profile_kernels").summarize(RAW)
    assert row["kernel"] == "attn_fwd_gluon"
    assert row["profiled_ms"] == 1.25 and row["instructions"] == 3625317  # us -> ms
    assert row["dram_read_gb"] == pytest.approx(0.5375)  # Mbyte -> Gbyte
    assert list(row["stalls"].items()) == [("barrier", 0.6), ("wait", 0.25)]  # no _not_issued, no zeros


def test_case_names_are_checked_before_anything_runs(monkeypatch, tmp_path):
    script = load_script("profile_kernels")
    assert script.parse_case("fa4:S1-256") == ("fa4", "S1", 256)
    for bad in ("flex:S1-256", "triton:S9-128", "triton:S1", "S1-256", "triton:S1-256-p16"):
        with pytest.raises(ValueError, match="--cases"):
            script.parse_case(bad)
    monkeypatch.setattr(sys, "argv", ["profile_kernels.py", "--out", str(tmp_path), "--cases", "triton:S1"])
    with pytest.raises(SystemExit):
        script.main()
