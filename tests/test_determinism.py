"""Determinism: every backend returns the same bits for the same inputs, call after call; the
per-sequence backends (reference, sdpa, and flex on CPU) also return a sequence's bits whatever
else shares its step. triton, fa4 and compiled flex pick kernels, tiles and KV splits per step
(every sequence at least a key tile long for TMA and Gluon, decode splits sized by the step's
work, FA4's built-in or sparse path, flex's decoding kernel for short steps), so a sequence's
result may round differently in another batch: still isolated (its values never depend on
another sequence's values), just not batch-invariant. The reference's bits depend on the values
alone, not on the process, thread count or the inputs' alignment; sdpa's and flex's CPU matrix
products round by operand alignment (README: Isolation and determinism)."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_isolation import VARIANTS, _inputs, _runner

import spanattn as sa
from spanattn.isolation import bitwise_equal

BATCH_INVARIANT = ("reference", "sdpa") + (() if torch.cuda.is_available() else ("flex",))


@pytest.mark.parametrize("name, backend, d, dtype, step, opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_same_inputs_same_bits(name, backend, d, dtype, step, opts):
    p, q, k, v = _inputs(step, "clamp", d, dtype)
    run = _runner(backend, p, q, opts)
    first, again = run(q, k, v), run(q.clone(), k.clone(), v.clone())
    assert bitwise_equal(first[0], again[0]) and bitwise_equal(first[1], again[1])


@pytest.mark.parametrize("backend", BATCH_INVARIANT)
def test_a_sequence_alone_or_in_a_batch_gives_the_same_bits(backend):
    variant = next(v for v in VARIANTS if v[0] == backend)
    _, _, d, dtype, step, opts = variant
    p, q, k, v = _inputs(step, "on", d, dtype)
    together = _runner(backend, p, q, opts)(q, k, v)
    cu_q, cu_k = p.cu_seqlens_q.tolist(), p.cu_seqlens_k.tolist()
    for i, seq in enumerate(p.batch.seqs):
        alone = sa.plan(sa.Batch([seq]), p.layer, device=q.device)
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        out, lse = _runner(backend, alone, q, opts)(q[rows], k[keys], v[keys])
        assert bitwise_equal(out, together[0][rows]) and bitwise_equal(lse, together[1][rows]), (
            f"sequence {i}"
        )


# The reference's results of the 5-sequence clamp step (fp32) in one process: with the thread
# count it starts with and with 1, its inputs at 0, 4 and 12 bytes past an aligned allocation.
FRESH = """
import hashlib, torch
from test_isolation import _inputs, _runner
p, q, k, v = _inputs("mixed", "clamp", 32, torch.float32)
run = _runner("reference", p, q, {})

def shifted(t, offset):
    out = torch.empty(t.numel() + offset)[offset:].view(t.shape)
    return out.copy_(t)

digests = set()
for threads in (torch.get_num_threads(), 1):
    torch.set_num_threads(threads)
    for offset in (0, 1, 3):
        out, lse = run(shifted(q, offset), shifted(k, offset), shifted(v, 2 * offset))
        digests.add(hashlib.sha256(out.numpy().tobytes() + lse.numpy().tobytes()).hexdigest())
print(*digests)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU matrix products: the CPU run covers it")
def test_reference_gives_the_same_bits_in_fresh_processes():
    """CPU BLAS products round by operand alignment and thread count: the reference had given
    one fresh process's first call other bits than its second. Its products are exact now
    (exact_matmul): a fresh process and this one, each at two thread counts and three
    alignments, give one result."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    fresh = subprocess.run(
        [sys.executable, "-c", FRESH], env=env, capture_output=True, text=True, timeout=120
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    threads = torch.get_num_threads()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(FRESH, {})
    finally:
        torch.set_num_threads(threads)
    digests = set(fresh.stdout.split()) | set(printed.getvalue().split())
    assert len(digests) == 1, digests
