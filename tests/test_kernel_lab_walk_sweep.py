"""tools/kernel_lab/walk_sweep.py on the CPU: the sweep's steps."""

import pytest
from bench_scripts import LAB, load_script

ws = load_script("walk_sweep", LAB)


@pytest.mark.parametrize("keys", [256, 1024, 4096])
def test_steps_hold_about_the_same_pairs_at_every_length(keys):
    p = ws.step(keys, device="cpu")
    assert p.allowed_pairs() == pytest.approx(ws.PAIRS, rel=0.01)
    assert set((p.cu_seqlens_k[1:] - p.cu_seqlens_k[:-1]).tolist()) == {keys}
    assert set((p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()) == {min(1024, keys)}
