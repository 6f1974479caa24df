"""What the block-table check costs a decode step in each of its modes, on one GPU in one call.

    python benchmarks/gpu_page_check.py --out results/ [--rounds 5] [--steps 20]
    python benchmarks/gpu_page_check.py --out /tmp/pc --tiny   # a smoke run on CPU (reference)

``sa.attention(..., block_table=...)`` checks, once per plan and block-table version, that every
block a sequence reads exists (spanattn/page_check.py), in one of three modes: ``off``
(``check_pages=False``), ``deferred`` (the default: on CUDA one launch, its result copied to
pinned memory behind an event, no sync; a later call raises) and ``sync`` (checked before the
call: a host sync). Here an eager decode loop runs as an engine's would: per step the block table
is copied in from pinned host memory (a new version of it), a plan is built for the step,
``layers`` attention calls of one layer kind read the paged cache (triton backend), and the step
ends with a sync (where an engine reads its sampled tokens). Per batch size and layer count the
three modes take turns by round (the order rotating); medians. Steps of attention alone (no
projections, no MLP) bound a check's share from above; rows with ``model`` add to every layer
what a Gemma 3 1B layer does besides attention (two RMS norms, the QKV and output projections,
the gated MLP at its sizes, bf16), the share in a model's eager decode step. Rows with
``inference`` run the loop under ``torch.inference_mode()`` with a table made there: such a
tensor has no version counter, so every layer's call checks it again (one launch merged into the
step's pending check), the price of knowing a table by what proves it unchanged.

Also timed, the check alone: the host time of the deferred launch (``page_check.defer``: what
the default adds to a step's host path), its device time (CUDA events around it), and the
synchronous check's wall time. First, on the same device, the behaviour: a table with a bad id
in one sequence runs (the clamp keeps its reads in the cache; the other sequences' outputs equal
a clean table's bit for bit), the next call raises naming the earlier step, and so does
``sa.check_pending_pages()``. Writes ``<date>-page-check-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

import spanattn as sa  # noqa: E402
from spanattn import page_check  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.cache import to_paged  # noqa: E402
from spanattn.scenarios import HKV, HQ  # noqa: E402

PAGE = 16
MODES = {"off": False, "deferred": True, "sync": "sync"}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _setup(dev: str, batch: int, kv_len: int, head_dim: int, dtype):
    seqs = [sa.Seq(q_len=1, kv_len=kv_len + 7 * i) for i in range(batch)]
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=dev)
    k, v = (torch.randn(plan.total_k, HKV, head_dim, device=dev, dtype=dtype) for _ in "kv")
    kc, vc, bt = to_paged(k, v, plan, PAGE, fill=float("nan"))
    q = torch.randn(batch, HQ, head_dim, device=dev, dtype=dtype)
    return seqs, q, kc, vc, bt


def _raised(fn) -> str | None:
    try:
        fn()
    except IndexError as err:
        return str(err)
    return None


def verify(dev: str, backend: str, dtype) -> dict:
    """The deferred check's behaviour on this device (see the module docstring); on a CPU table
    the default checks at once, so there the bad call itself raises."""
    seqs, q, kc, vc, bt = _setup(dev, 3, 100, 64, dtype)
    plan = lambda: sa.plan(sa.Batch(seqs), sa.LayerMask(), device=dev)
    call = lambda p, table, mode=True: sa.attention(q, kc, vc, p, block_table=table, backend=backend,
                                                    check_pages=mode)  # fmt: skip
    sa.check_pending_pages()
    clean = call(plan(), bt, False)
    bad = bt.clone()
    bad[1, 0] = kc.shape[0] + 7
    res = {"bad_entry": [1, 0, kc.shape[0] + 7]}
    out = []
    res["bad_call_raised"] = _raised(lambda: out.append(call(plan(), bad)))
    out = out[0] if out else call(plan(), bad, False)
    rows = [plan().seq_slice(r) for r in (0, 2)]
    res["neighbours_bit_equal"] = all(torch.equal(out[s], clean[s]) for s in rows)
    _sync(dev)  # the check has completed: the next call finds it
    res["next_call_raised"] = _raised(lambda: call(plan(), bt))
    _raised(lambda: call(plan(), bad))  # deferred again, for check_pending_pages to find
    res["check_pending_pages_raised"] = _raised(sa.check_pending_pages)
    res["sync_raised"] = _raised(lambda: call(plan(), bad, "sync"))
    deferred = dev == "cuda"
    res["ok"] = (
        res["neighbours_bit_equal"]
        and (res["bad_call_raised"] is None) == deferred
        and (res["next_call_raised"] is not None) == deferred
        and (res["check_pending_pages_raised"] is not None) == deferred
        and res["sync_raised"] is not None
    )
    sa.check_pending_pages()
    return res


# Gemma 3 1B's decoder layer besides attention: hidden 1152, 4 query heads and 1 KV head of 256,
# MLP 6912 (the attention itself runs at the benchmark's own heads).
HIDDEN, QKV_OUT, O_IN, MLP = 1152, 1536, 1024, 6912


def _model_weights(dev, dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = ((HIDDEN, QKV_OUT), (O_IN, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN))
    return [torch.randn(s, device=dev, dtype=dtype, generator=g) * s[0] ** -0.5 for s in shapes]


def _layer_rest(x, weights):
    """A decoder layer's work besides attention (its launches are what a step's host pays)."""
    w_qkv, w_o, w_gate_up, w_down = weights
    qkv = torch.nn.functional.rms_norm(x, (HIDDEN,)) @ w_qkv
    x = x + qkv[:, :O_IN] @ w_o
    gate, up = (torch.nn.functional.rms_norm(x, (HIDDEN,)) @ w_gate_up).chunk(2, -1)
    return x + (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ w_down


def _step_ms(dev, backend, seqs, q, kc, vc, bt, host_bt, layers: int, mode, steps: int, model=None) -> float:
    """Median wall time of ``steps`` engine steps, each ending in a sync; ``model``: the other
    work of each layer (``_model_weights``)."""
    times = []
    x = torch.zeros(len(seqs), HIDDEN, device=q.device, dtype=q.dtype) if model else None
    for _ in range(steps):
        t0 = time.perf_counter()
        bt.copy_(host_bt, non_blocking=True)  # the engine's per-step table upload: a new version
        plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=dev)
        for _ in range(layers):
            if model:
                x = _layer_rest(x, model)
            sa.attention(q, kc, vc, plan, block_table=bt, backend=backend, check_pages=mode)
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _alone(dev, seqs, kc, bt, steps: int) -> dict:
    """The check without the step: the deferred launch's host time (and device time on CUDA),
    the synchronous check's wall time."""
    plan = sa.plan(sa.Batch(seqs), sa.LayerMask(), device=dev)
    host, device, sync = [], [], []
    for _ in range(steps):
        _sync(dev)
        if dev == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        page_check.defer(bt, plan, kc.shape[0], PAGE)
        host.append((time.perf_counter() - t0) * 1e3)
        if dev == "cuda":
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end))
        sa.check_pending_pages()
        _sync(dev)
        t0 = time.perf_counter()
        page_check.check_now(bt, plan, kc.shape[0], PAGE)
        sync.append((time.perf_counter() - t0) * 1e3)
    med = lambda xs: round(statistics.median(xs), 4) if xs else None
    return {"defer_host_ms": med(host), "defer_device_ms": med(device), "sync_check_ms": med(sync)}


def run(
    dev, backend, dtype, batch, kv_len, head_dim, layers, rounds, steps, model=False, inference=False
) -> dict:
    seqs, q, kc, vc, bt = _setup(dev, batch, kv_len, head_dim, dtype)
    host_bt = bt.cpu().pin_memory() if dev == "cuda" else bt.clone()
    if inference:
        with torch.inference_mode():
            bt = bt.clone()  # an inference tensor: no version counter
    args = (dev, backend, seqs, q, kc, vc, bt, host_bt, layers)
    weights = _model_weights(dev, dtype) if model else None
    names = list(MODES)
    with torch.inference_mode(inference):
        for name in names:  # compile and warm every path
            _step_ms(*args, MODES[name], min(steps, 2), weights)
        times = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                times[name].append(_step_ms(*args, MODES[name], steps, weights))
    ms = {name: statistics.median(t) for name, t in times.items()}
    row = {"batch": batch, "kv_len": kv_len, "head_dim": head_dim, "layers": layers, "model": model,
           "inference": inference}  # fmt: skip
    for name in names:
        row[f"step_ms_{name}"] = round(ms[name], 4)
    for name in ("deferred", "sync"):
        row[f"share_{name}"] = round((ms[name] - ms["off"]) / ms["off"], 4)
    row.update(_alone(dev, seqs, kc, bt, steps))
    row["defer_host_share"] = round(row["defer_host_ms"] / ms["off"], 4)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for <date>-page-check-<gpu>.json")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="CPU, reference backend, toy sizes")
    args = ap.parse_args(argv)
    if args.tiny:
        dev, backend, dtype = "cpu", "reference", torch.float32
        configs = [(2, 40, 1, False, False), (2, 40, 2, False, False), (2, 40, 2, True, False)]
        configs += [(2, 40, 2, True, True)]
        args.rounds, args.steps = 3, 1
    else:
        dev, backend, dtype = "cuda", "triton", torch.bfloat16
        sizes = ((8, 4096), (64, 4096), (256, 2048))
        configs = [(b, kv, layers, False, False) for b, kv in sizes for layers in (1, 26)]
        configs += [(b, kv, 26, True, inference) for b, kv in sizes for inference in (False, True)]
    env = environment(dev)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    print(json.dumps(env), flush=True)
    checked = verify(dev, backend, dtype)
    print("behaviour:", json.dumps(checked), flush=True)
    rows = []
    for i, (batch, kv_len, layers, model, inference) in enumerate(configs):
        row = run(dev, backend, dtype, batch, kv_len, 128 if dev == "cuda" else 16, layers, args.rounds,
                  args.steps, model, inference)  # fmt: skip
        rows.append(row)
        print(f"[{i + 1}/{len(configs)}]", json.dumps(row), flush=True)
    path = result_path(args.out, "page-check", env)
    meta = {"env": env, "backend": backend, "page": PAGE, "modes": list(MODES), "behaviour": checked}
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print("wrote", path)
    return 0 if checked["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
