"""The command line and the pictures: `spanattn show`, `spanattn demo`, the lazy `bench`
hand-over, and viz drawing from intervals only."""

import sys
import time
import types

import pytest
import torch

import spanattn as sa
from spanattn import viz
from spanattn.cli import main

# Seq(q_len=8, kv_len=12, spans=[(3, 7)]) under LayerMask(window=4, spans="clamp"), by hand:
# ctx = 4, queries 4..11. Base rule: keys [q-3, q]. Queries 4..7 lie in the span [3, 7] and also
# see its keys up to 7, clamped to the window on the past side: [max(3, q-3), 7] -> union [q-3, 7].
TINY_ASCII = """\
seq 0: q_len 8 of kv_len 12 (ctx 4), causal; layer window=4, spans='clamp'
 key 012345678901
 ctx cccc
span    aaaaa
  4a .#######....
  5a ..######....
  6a ...#####....
  7a ....####....
  8  .....####...
  9  ......####..
 10  .......####.
 11  ........####"""


def run_cli(argv):
    """Exit code of main(argv), whether it returns or exits the way argparse does."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_show_tiny_ascii_is_exact(capsys, tmp_path):
    assert run_cli(["show", "--preset", "tiny", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert TINY_ASCII in out
    assert "allowed pairs 38" in out  # 7+6+5+4 + 4*4
    png = tmp_path / "mask.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_writes_png_of_described_step(capsys, tmp_path):
    png = tmp_path / "sub" / "m.png"
    argv = ["show", "--q-len", "64", "--kv-len", "96", "--spans", "40-79", "--window", "16"]
    assert run_cli(argv + ["--mode", "clamp", "--non-causal", "--out", str(png)]) == 0
    assert png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "non-causal" in out and "spans [40,79]" in out and f"wrote {png}" in out


def test_show_several_seqs(capsys):
    argv = ["show", "--seq", "q=6,kv=10,spans=1-2,5-7", "--seq", "q=1,kv=9", "--seq", "q=4,causal=0"]
    assert run_cli(argv + ["--window", "3", "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "spans [1,2], [5,7]" in out and "3 seqs" in out and "non-causal" in out
    # the decode row (q 8 of kv 9, window 3) sees keys 6..8
    assert "  8  ......###" in out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--q-len", "100", "--kv-len", "50"], "kv_len"),
        (["--q-len", "10", "--spans", "2-5,4-6"], "spans"),
        (["--q-len", "4", "--window", "0"], "window"),
        (["--q-len", "10", "--kv-len", "12", "--spans", "8-13", "--prompt-len", "20"], "allow-split-spans"),
        (["--seq", "q=4", "--seq", "q=5,kv=3"], "--seq 1: Seq.kv_len"),
        (["--q-len", "4", "--draw-seq", "3"], "--draw-seq"),
    ],
)
def test_validation_error_is_one_line_exit_2(capsys, argv, named):
    assert run_cli(["show", *argv, "--no-png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spanattn show: error:") and named in err
    assert "\n" not in err and "Traceback" not in err


def test_bad_option_values_exit_2(capsys):
    assert run_cli(["show", "--q-len", "3", "--window", "abc"]) == 2
    assert "--window" in capsys.readouterr().err
    assert run_cli(["show", "--seq", "kv=4"]) == 2
    assert run_cli(["demo", "--backends", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_demo_runs_on_cpu(capsys, tmp_path):
    t0 = time.perf_counter()
    assert run_cli(["demo", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "on+drop-wide" in out
    for layer in ("sliding", "global", "global-on"):
        assert f"{layer:<15} reference  float32" in out
        assert f"{layer + ' grad':<15} sdpa       float32" in out  # a training step's gradients, checked
        assert (tmp_path / f"demo-{layer}.png").stat().st_size > 10_000
    assert (tmp_path / "demo-modes.png").exists()
    assert time.perf_counter() - t0 < 120


def test_bench_is_imported_only_when_chosen(monkeypatch, capsys):
    seen = {}
    fake = types.ModuleType("spanattn.bench")
    fake.add_arguments = lambda p: p.add_argument("--reps", type=int, default=1)

    def fake_main(args):
        seen["reps"] = args.reps
        return 0

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "spanattn.bench", fake)
    assert run_cli(["bench", "--reps", "3"]) == 0 and seen == {"reps": 3}
    # a bench that cannot be imported breaks only `bench`
    monkeypatch.setitem(sys.modules, "spanattn.bench", None)
    assert run_cli(["show", "--preset", "tiny", "--no-png"]) == 0
    assert run_cli(["bench"]) == 2
    assert "cannot import spanattn.bench" in capsys.readouterr().err


def test_coverage_is_exact():
    """Per-pixel allowed fractions from intervals equal the dense mask pooled the same way."""
    g = torch.Generator().manual_seed(0)
    for t in range(40):
        kv = int(torch.randint(1, 70, (1,), generator=g))
        q = int(torch.randint(1, kv + 1, (1,), generator=g))
        w = int(torch.randint(1, kv + 1, (1,), generator=g))
        p = sa.plan(sa.Batch([sa.Seq(q_len=q, kv_len=kv, causal=bool(t % 2))]), sa.LayerMask(window=w))
        dense = p.to_dense(0).double()
        for r, c in ((1, 1), (2, 3), (7, 5)):
            rows, cols = -(-q // r), -(-kv // c)
            padded = torch.zeros(rows * r, cols * c, dtype=torch.float64)
            padded[:q, :kv] = dense
            count = padded.view(rows, r, cols, c).sum((1, 3))
            n_r = torch.tensor([min(r, q - i * r) for i in range(rows)])
            n_c = torch.tensor([min(c, kv - j * c) for j in range(cols)])
            expect = count / (n_r[:, None] * n_c[None]).double()
            assert torch.equal(viz.coverage(p.lo.long(), p.hi.long(), kv, r, c), expect)


def test_draw_large_plan_never_builds_a_dense_mask(monkeypatch, tmp_path):
    spans = [(200 + i * 2035, 200 + i * 2035 + 1119) for i in range(16)]
    p = sa.plan(sa.Batch([sa.Seq(q_len=32768, spans=spans)]), sa.LayerMask(window=1024, spans="clamp"))

    def no_dense(*a, **k):
        raise AssertionError("viz must draw from the intervals, not a dense mask")

    monkeypatch.setattr(sa.Plan, "to_dense", no_dense)
    monkeypatch.setattr("spanattn.intervals.dense_from_intervals", no_dense)
    t0 = time.perf_counter()
    viz.draw(p, tmp_path / "big.png")
    assert time.perf_counter() - t0 < 30  # seconds on a loaded 2-core CPU; a dense 32k mask is 1 GiB
    assert (tmp_path / "big.png").stat().st_size > 10_000


def test_ascii_refuses_large_steps_and_compare_draws(tmp_path):
    p = sa.plan(sa.Batch([sa.Seq(q_len=200, kv_len=400)]), sa.LayerMask(window=8))
    with pytest.raises(ValueError, match="draw"):
        viz.ascii(p)
    plans = {
        m: sa.plan(sa.Batch([sa.Seq(20, spans=[(4, 15)])]), sa.LayerMask(4, m)) for m in sa.spec.SPAN_MODES
    }
    assert viz.compare(plans, tmp_path / "c.png") == str(tmp_path / "c.png")
