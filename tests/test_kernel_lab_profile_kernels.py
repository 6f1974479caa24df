"""tools/kernel_lab/profile_kernels.py's CPU-checkable parts: reading ncu's raw counter page, and its
refusal of cases it cannot profile (the profiling itself needs a GPU and ncu)."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import LAB, load_script

RAW = (
    '"Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum","smsp__pcsamp_sample_count",'
    '"smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_wait_not_issued",'
    '"smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_sleeping",'
    '"dram__bytes_read.sum"\n'
    '"","us","inst","","warp","warp","warp","warp","Mbyte"\n'
    '"attn_fwd_gluon","1,250","3,625,317","1,000","250","100","600","0","537.5"\n'
)


def test_counters_are_read_per_kernel_with_stall_shares_largest_first():
    (row,) = load_script("profile_kernels", LAB).summarize(RAW)
    assert row["kernel"] == "attn_fwd_gluon"
    assert row["profiled_ms"] == 1.25 and row["instructions"] == 3625317  # us -> ms
    assert row["dram_read_gb"] == pytest.approx(0.5375)  # Mbyte -> Gbyte
    assert list(row["stalls"].items()) == [("barrier", 0.6), ("wait", 0.25)]  # no _not_issued, no zeros


# Two kernels' SASS pages, as ``ncu -i --page source --print-source sass --csv`` prints them: each
# after a line naming the kernel, a header with the instruction's address and text, the samples
# and a column per stall reason with its not-issued twin, then a row per instruction (the second
# kernel's page without per-reason columns).
PAGE = (
    '"Kernel Name","attn_fwd_gluon",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"stall_barrier","stall_wait","stall_barrier (Not Issued)","stall_wait (Not Issued)"\n'
    '"0x10","      BAR.SYNC.DEFER_BLOCKING 0x1 ;","300","300","300","0","300","0"\n'
    '"0x20","@P0 BAR.SYNC.DEFER_BLOCKING 0x0, 0x80 ;","100","100","80","20","80","20"\n'
    '"0x30","SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR18+0x30130], R24 ;","50","50","0","50","0","50"\n'
    '"0x40","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR11+0x30160], R0 ;","50","50","0","10","0","10"\n'
    '"0x50","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;","500","0","0","0","0","0"\n'
    '"0x60","FFMA R1, R2, R3, R4 ;","0","0","0","0","0","0"\n'
    '"Kernel Name","flash_fwd",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)"\n'
    '"0x10","MUFU.EX2 R5, R6 ;","3"\n'
    '"0x20","BAR.SYNC.DEFER_BLOCKING 0x1 ;","1"\n'
)


def test_source_page_samples_are_summed_per_kernel_by_instruction_kind():
    ours, theirs = load_script("profile_kernels", LAB).summarize_source(PAGE, top=2)
    assert ours["samples"] == 1000
    assert ours["by_kind"] == {
        "HGMMA.64x64x16": 0.5,
        "BAR.SYNC.DEFER_BLOCKING 0x1": 0.3,
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x80": 0.1,  # its predicate dropped
        "SYNCS.PHASECHK (mbarrier wait)": 0.1,  # both barriers' waits together
    }  # the unsampled FFMA absent
    assert [(t["address"], t["share"]) for t in ours["top"]] == [("0x50", 0.5), ("0x10", 0.3)]
    assert ours["top"][1]["stalls"] == {"barrier": 1.0}  # no not-issued twin, no zeros
    assert theirs == {
        "samples": 4,
        "by_kind": {"MUFU.EX2": 0.75, "BAR.SYNC.DEFER_BLOCKING 0x1": 0.25},
        "top": [{"address": "0x10", "sass": "MUFU.EX2 R5, R6 ;", "share": 0.75, "stalls": {}},
                {"address": "0x20", "sass": "BAR.SYNC.DEFER_BLOCKING 0x1 ;", "share": 0.25, "stalls": {}}],
    }  # fmt: skip


def test_case_names_are_checked_before_anything_runs(monkeypatch, tmp_path):
    script = load_script("profile_kernels", LAB)
    assert script.parse_case("fa4:S1-256") == ("fa4", "S1", 256)
    for bad in ("flex:S1-256", "triton:S9-128", "triton:S1", "S1-256", "triton:S1-256-p16"):
        with pytest.raises(ValueError, match="--cases"):
            script.parse_case(bad)
    monkeypatch.setattr(sys, "argv", ["profile_kernels.py", "--out", str(tmp_path), "--cases", "triton:S1"])
    with pytest.raises(SystemExit):
        script.main()


def test_source_ledger_lands_in_each_case_of_the_json(monkeypatch, tmp_path):
    """main()'s wiring with ncu and the GPU faked: the counters and the source page's ledger
    meet in one row per case, and the page itself is kept beside the JSON."""
    import gzip
    import json
    import subprocess
    import types

    import torch

    import spanattn.bench.report as report

    script = load_script("profile_kernels", LAB)
    one_kernel_page = PAGE.split('"Kernel Name","flash_fwd"')[0]
    timed = [{"case": "triton:S1-256", "event_ms": 1.3, "allowed_pairs": 10}]

    names = [*script.METRICS.values(), script.SAMPLES]
    units = {"gpu__time_duration.sum": "us", "dram__bytes_read.sum": "Mbyte"}
    raw = "\n".join([",".join(names), ",".join(units.get(n, "") for n in names),
                     ",".join("attn_fwd_gluon" if n == "Kernel Name" else "50" for n in names)])  # fmt: skip
    out = {"--child": "TIMED " + json.dumps(timed), "raw": raw, "source": one_kernel_page}

    def fake_run(cmd, **kw):
        stdout = next(v for k, v in out.items() if k in cmd)
        return types.SimpleNamespace(returncode=0, stderr="", stdout=stdout)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(script.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = {"date": "2026-12-02T10:00", "gpu": "NVIDIA H200"}
    monkeypatch.setattr(report, "environment", lambda device: env)
    argv = ["profile_kernels.py", "--out", str(tmp_path), "--cases", "triton:S1-256", "--source"]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    (row,) = json.loads((tmp_path / "2026-12-02-kernel-counters-h200.json").read_text())["cases"]
    assert row["case"] == "triton:S1-256" and row["kernel"] == "attn_fwd_gluon"
    assert row["source"]["samples"] == 1000 and row["source"]["by_kind"]["HGMMA.64x64x16"] == 0.5
    page = gzip.decompress((tmp_path / "2026-12-02-kernel-counters-h200-sass.csv.gz").read_bytes()).decode()
    assert page == one_kernel_page
