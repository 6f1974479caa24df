"""Every prefill kernel variant that configs.pick hands out compiles for sm_90 (H100/H200) on
any machine, with triton's own ptxas, fits the shared memory one block may use there and keeps
its wgmma asynchronous (no serialization, no waits ptxas had to inject). So a kernel edit made
without a GPU is still held to what the GPU needs. tools/kernel_lab/compile_stats.py runs in a
subprocess: the interpreter the other tests run under cannot compile for a GPU."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
SMEM_PER_BLOCK = 232448  # bytes of shared memory one block may use on sm_90


@pytest.fixture(scope="module")
def reports():
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        found = Path(get_ptxas(90).path).exists()
    except (RuntimeError, OSError):
        found = False
    if not found:
        pytest.skip("no ptxas for sm_90 with this triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = ROOT / "tools" / "kernel_lab" / "compile_stats.py"
    run = subprocess.run(
        [sys.executable, str(script), "--shipped"], capture_output=True, text=True, env=env, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_every_shipped_variant_compiles_for_hopper(reports):
    assert {r["d"] for r in reports} == {64, 128, 256, 512}
    assert any(r["config"]["gluon"] for r in reports) and any(r["page"] for r in reports)
    assert {r["groups"] for r in reports} == {"", "on", "clamp"}
    for r in reports:
        assert r["shared_bytes"] <= SMEM_PER_BLOCK, r
        assert not r["wgmma_serialized"] and not r["wgmma_wait_injected"], r


def test_gluon_softmax_runs_under_its_p_at_v(reports):
    """Each Gluon loop's P @ V is waited for after the next tile's exponentials, not before its
    row maxima (gluon_pv_wait.py): a tile's 64 (d128), 32 (d256) or 16 (d512) per row pair, and
    two more for the rescale factors."""
    per_row_pair = {128: 66, 256: 34, 512: 18}
    for r in (r for r in reports if r["config"]["gluon"]):
        loops = r["exps_under_pv"]
        assert loops and min(loops) >= per_row_pair[r["d"]], r


def test_gluon_rescale_runs_under_its_q_at_k(reports):
    """kernel_gluon's rescale of the output before a tile's P @ V is issued after the Q @ K^T
    before it, behind the wait for the values (kernel_gluon._rescaled): of a thread's 64 (d128)
    or 128 (d256) multiplies all but a few lie between the two issues (LLVM had hoisted them all
    ahead of the Q @ K^T)."""
    for r in (r for r in reports if r["config"]["gluon"] and r["d"] in (128, 256)):
        loops = r["rescales_under_scores"]
        assert loops and min(loops) >= r["d"] // 2 - 4, r


def test_gluon_backward_compiles_for_hopper(reports):
    """The Gluon backward kernels (kernel_gluon_dkdv and its split form, kernel_gluon_dq; with
    and without a softcap) fit sm_90's shared memory, keep their wgmma asynchronous and spill at
    most a few registers: holding a tile's scores, their gradients, the previous tile's operands
    in flight and the fp32 gradients of the program's rows in the consumers' 240 registers is
    what their tiles are sized for (triton 3.6: 0-12 bytes a thread; 3.9: up to 68 with a
    softcap at d256)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = ROOT / "tools" / "kernel_lab" / "compile_stats_backward.py"
    run = subprocess.run([sys.executable, str(script), "--gluon"], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12  # dK/dV and dQ, d128, d256 and d512, softcap off and on
    for r in rows:
        assert r["shared_bytes"] <= SMEM_PER_BLOCK and r["wgmma"], r
        assert not r["wgmma_serialized"] and not r["wgmma_wait_injected"], r
        spilled = int(re.search(r"(\d+) bytes spill stores", " ".join(r["ptxas"])).group(1))
        assert spilled <= 128, r
