"""tools/kernel_lab/clocks.py on CPU: nvidia-smi's samples parsed and windowed exactly, a bad case
named, and the run itself refused without a GPU."""

from __future__ import annotations

from datetime import datetime

import pytest
from bench_scripts import LAB, load_script

LINES = [
    "2026/12/04 18:40:01.000, 1980, 75.10",
    "2026/12/04 18:40:01.100, 1590, 480.00",
    "2026/12/04 18:40:01.200, N/A, N/A",
    "2026/12/04 18:40:01.300, 1575, 490.50",
    "2026/12/04 18:40:01.400, 1500, 500.00",
    "",
]


def _clocks():
    load_script("short_walks")  # what clocks.py imports from benchmarks/
    return load_script("clocks", LAB)


def test_samples_parsed_and_windowed():
    clocks = _clocks()
    samples = clocks.parse_samples(LINES)
    t0 = datetime(2026, 12, 4, 18, 40, 1).timestamp()
    assert [(round(t - t0, 3), c, w) for t, c, w in samples] == [
        (0.0, 1980.0, 75.1), (0.1, 1590.0, 480.0), (0.3, 1575.0, 490.5), (0.4, 1500.0, 500.0)]  # fmt: skip
    # the first 0.2 s of a block are the clock leaving idle: 1980 and 1590 are left out
    assert clocks.window(samples, t0, t0 + 0.45) == {"mhz": 1537.5, "watts": 495.25, "samples": 2}
    assert clocks.window(samples, t0 + 1, t0 + 2) == {"mhz": None, "watts": None, "samples": 0}


def test_a_bad_case_is_named_and_no_gpu_refused(tmp_path, capsys):
    clocks = _clocks()
    with pytest.raises(SystemExit):
        clocks.main(["--out", str(tmp_path), "--scenarios", "S2-64"])
    assert "--scenarios: S2-64 not among" in capsys.readouterr().err
    assert clocks.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
