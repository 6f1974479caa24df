"""The torch ops, torch.compile and one-graph capture of a device-planned step, checked on one GPU
in one call (CPU: a smoke run of the same code, tiny steps, triton in its interpreter, graph checks skipped).

    python benchmarks/gpu_ops.py --out DIR        # writes DIR/<date>-ops-<gpu>.json, ~2 minutes

opcheck: torch.library.opcheck of spanattn::attention / attention_lse (device plans) and their
    host-plan twins (packed and paged, prefill and decode kernels) for triton, and fa4 when it imports, and of
    spanattn::write_kv_cache.
compile: torch.compile(fullgraph=True, dynamic=True) with inductor of a function calling
    sa.write_kv_cache and sa.attention (triton, paged) over 20 steps of different lengths, spans
    and batch compositions: no recompilation after the first, outputs equal to eager.
graph: ONE CUDA graph holding DevicePlanner.update (two layer kinds: sliding/clamp and
    global/on), the cache writes and attention of both, captured once per capacity (a prefill
    capacity on the prefill kernel, a decode capacity on the split-KV kernel) and replayed on
    new metadata (lengths, spans, causal flags, pages, sequence counts): every replay equal
    to an eager run on the same metadata (exact: the same kernels and tables), and within
    the numerics rule (docs/design.md section 4) of the host plan's reference.
example: examples/paged_engine.py end to end (a CUDA graph per step on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the smoke run's triton launches go to Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import spanattn as sa  # noqa: E402
from spanattn import ops  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.cache import slot_mapping  # noqa: E402
from spanattn.oracle import Truth  # noqa: E402

LAYERS = {"sliding": sa.LayerMask(window=64, spans="clamp"), "global": sa.LayerMask(spans="on")}
PAGE = 16


class Env:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float16
        self.hq, self.hkv, self.d = (16, 8, 128) if self.cuda else (2, 1, 16)
        self.scale = 4 if self.cuda else 1  # lengths grow on the GPU

    def randn(self, *shape, g):
        return torch.randn(*shape, generator=g, device=self.device).to(self.dtype)


def random_batch(r: random.Random, env: Env, max_seqs: int, max_len: int, max_q: int | None = None):
    seqs = []
    for _ in range(r.randint(2, max_seqs)):
        kv = r.randint(2, max_len)
        q = min(kv, max_q) if max_q else kv
        q = r.choice([1, q, r.randint(1, q)])
        spans = []
        if kv > 12 and r.random() < 0.6:
            s = r.randint(0, kv - 6)
            spans = [(s, min(kv - 1, s + r.randint(0, 40)))]
        seqs.append(sa.Seq(q_len=q, kv_len=kv, spans=spans, causal=r.random() < 0.8))
    return sa.Batch(seqs)


def paged(env: Env, batch: sa.Batch, num_blocks: int, width: int, seed: int):
    """Caches holding every key of the batch in shuffled pages (unowned slots NaN), the block
    table and the step's new q, k, v."""
    g = torch.Generator(device=env.device).manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=g, device=env.device)[: len(batch) * width]
    bt = ids.view(len(batch), width).to(torch.int32)
    kc = torch.full((num_blocks, PAGE, env.hkv, env.d), float("nan"), device=env.device, dtype=env.dtype)
    vc = kc.clone()
    full = sa.plan(sa.Batch([sa.Seq(q_len=s.kv_len) for s in batch.seqs]), sa.LayerMask(), device=env.device)
    k, v = env.randn(full.total_q, env.hkv, env.d, g=g), env.randn(full.total_q, env.hkv, env.d, g=g)
    sa.write_kv_cache(k, v, kc, vc, slot_mapping(full, bt, PAGE))
    q = env.randn(batch.total_q, env.hq, env.d, g=g)
    return q, k, v, kc, vc, bt


def check_opcheck(env: Env, report: dict):
    layer = LAYERS["sliding"]
    batch = sa.Batch([sa.Seq(q_len=40, kv_len=90, spans=[(50, 80)]), sa.Seq(q_len=1, kv_len=33), sa.Seq(12)])
    decode = sa.Batch([sa.Seq(q_len=1, kv_len=90), sa.Seq(q_len=3, kv_len=33), sa.Seq(q_len=2, kv_len=12)])
    plan = sa.plan(batch, layer, device=env.device)
    q, k, v, kc, vc, bt = paged(env, batch, 40, 8, 0)  # k, v: every key, packed (varlen order)
    cases = []
    for backend in ("triton", "fa4"):
        why = sa.backends.load(backend).unavailable(q, plan)
        if why is not None:
            report[f"opcheck {backend}"] = {"skipped": why}
            continue
        for kind, (kk, vv, table) in (("packed", (k, v, None)), ("paged", (kc, vc, bt))):
            if backend == "fa4" and table is not None:
                continue  # fa4 reads packed K/V only
            args = (
                q,
                kk,
                vv,
                plan.lo,
                plan.hi,
                None,
                None,
                None,
                [],
                table,
                plan.handle,
                "",
                backend,
                None,
                None,
            )
            cases.append((f"{backend}/host/{kind}", args))
    btp = torch.cat([bt, bt[:1].expand(2, -1)])  # rows of the planner's padding sequences
    for kind, step, max_q_len in (("prefill", batch, None), ("decode", decode, 16)):
        planner = sa.DevicePlanner({"l": layer}, max_seqs=5, max_tokens=step.total_q, max_kv_len=128,
                                   max_spans=3, max_q_len=max_q_len, device=env.device)  # fmt: skip
        planner.prepare("triton", head_dim=env.d, dtype=env.dtype, group=env.hq // env.hkv)
        dp = planner.update(*_inputs(step, env))["l"]
        args = (q[: step.total_q], kc, vc, dp.lo, dp.hi, dp.cu_seqlens_q, dp.cu_seqlens_k, dp.seq_lens,
                dp.op_tables, btp, None, dp.op_meta, "triton", None, None)  # fmt: skip
        cases.append((f"triton/device/{kind}", args))
    host_ops = (ops.host_attention_op, ops.host_attention_lse_op)  # never recorded in CUDA graphs
    for name, args in cases:
        for op in host_ops if "/host/" in name else (ops.attention_op, ops.attention_lse_op):
            _record(report, f"opcheck {name} {op._name}", lambda op=op, args=args: _opcheck(op, args))
    slots = torch.tensor([3, -1, 17, 40, 63], device=env.device)
    kn, vn = (env.randn(5, env.hkv, env.d, g=None) for _ in range(2))
    cache = torch.zeros(4, PAGE, env.hkv, env.d, device=env.device, dtype=env.dtype)
    args = (kn, vn, cache, cache.clone(), slots, None)
    _record(report, "opcheck write_kv_cache", lambda: _opcheck(ops.write_kv_cache_op, args))


def _opcheck(op, args):
    out = torch.library.opcheck(op, args)
    return {"ok": all(v == "SUCCESS" for v in out.values()), "tests": out}


def _inputs(batch, env):
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=env.device)
    spans = [(i, s, e) for i, seq in enumerate(batch.seqs) for s, e in seq.spans]
    seqs = batch.seqs
    return (
        t([s.q_len for s in seqs]),
        t([s.kv_len for s in seqs]),
        t([s.causal for s in seqs]),
        t(spans).view(-1, 3),
    )


def check_compile(env: Env, steps: int) -> dict:
    def fn(q, k_new, v_new, kc, vc, slots, bt, plan):
        sa.write_kv_cache(k_new, v_new, kc, vc, slots)
        return sa.attention(q, kc, vc, plan, block_table=bt, backend="triton") * 2

    torch._dynamo.reset()
    backend = "inductor" if env.cuda else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    r, equal = random.Random(1), []
    # The first step: sizes all distinct (dynamic shapes give sizes equal on the first call one
    # symbol, a guard a later step fails).
    first = [
        sa.Seq(q_len=37, kv_len=70 * env.scale, spans=[(9, 30)]),
        sa.Seq(q_len=5, kv_len=29),
        sa.Seq(1, 51),
    ]
    for step in range(steps):
        batch = sa.Batch(first) if step == 0 else random_batch(r, env, 5, 60 * env.scale)
        plan = sa.plan(batch, LAYERS["sliding"], device=env.device)
        q, k, v, kc, vc, bt = paged(env, batch, 60 + 45 * env.scale, 6 * env.scale, step)
        full = sa.plan(
            sa.Batch([sa.Seq(q_len=s.kv_len) for s in batch.seqs]), sa.LayerMask(), device=env.device
        )
        slots = slot_mapping(full, bt, PAGE)  # every key is new: the step writes them all
        want = fn(q, k, v, kc.clone(), vc.clone(), slots, bt, plan)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            equal.append(bool(torch.equal(compiled(q, k, v, kc, vc, slots, bt, plan), want)))
    return {"ok": all(equal), "steps": steps, "backend": backend, "equal_to_eager": equal}


def check_graph(env: Env, report: dict):
    if not env.cuda:
        report["graph"] = {"skipped": "CUDA graphs need a GPU"}
        return
    # (kind, max_q_len, max_seqs, longest kv): the prefill kernel, then the split-KV kernel
    for case in (("prefill", None, 8, 700), ("decode", 8, 12, 4000)):
        _record(report, f"graph {case[0]}", lambda case=case: _graph_case(env, *case))


def _graph_case(env: Env, kind, max_q_len, max_seqs, max_len):
    width = -(-max_len // PAGE)
    num_blocks = max_seqs * width + 8
    max_tokens = max_seqs * (max_q_len or max_len)
    planner = sa.DevicePlanner(LAYERS, max_seqs=max_seqs, max_tokens=max_tokens, max_kv_len=width * PAGE,
                               max_spans=max_seqs, max_q_len=max_q_len, device=env.device)  # fmt: skip
    planner.prepare("triton", head_dim=env.d, dtype=env.dtype, group=env.hq // env.hkv)
    dev, i32 = env.device, torch.int32
    static = {
        "q_lens": torch.zeros(max_seqs, dtype=i32, device=dev),
        "kv_lens": torch.zeros(max_seqs, dtype=i32, device=dev),
        "causal": torch.ones(max_seqs, dtype=i32, device=dev),
        "spans": torch.full((max_seqs, 3), -1, dtype=i32, device=dev),
        "bt": torch.zeros(max_seqs, width, dtype=i32, device=dev),
        "slots": torch.full((max_tokens,), -1, dtype=torch.int64, device=dev),
    }
    zeros = lambda *shape: torch.zeros(*shape, device=dev, dtype=env.dtype)
    qkv = {n: [zeros(max_tokens, h, env.d) for h in (env.hq, env.hkv, env.hkv)] for n in LAYERS}
    caches = {n: [zeros(num_blocks, PAGE, env.hkv, env.d) for _ in range(2)] for n in LAYERS}

    def step():
        plans = planner.update(static["q_lens"], static["kv_lens"], static["causal"], static["spans"])
        outs = {}
        for name, (kc, vc) in caches.items():
            q, k, v = qkv[name]
            sa.write_kv_cache(k, v, kc, vc, static["slots"])
            outs[name] = sa.attention(q, kc, vc, plans[name], block_table=static["bt"], backend="triton")
        return outs

    def load(batch, seed):
        """The step's metadata into the static buffers, every earlier key of each sequence into
        fresh pages (unowned slots NaN), new q/k/v rows."""
        n = len(batch)
        q_l, kv_l, causal, spans = _inputs(batch, env)
        static["q_lens"].zero_()
        static["kv_lens"].zero_()
        static["causal"].fill_(1)
        static["spans"].fill_(-1)
        static["slots"].fill_(-1)
        static["bt"].zero_()
        static["q_lens"][:n], static["kv_lens"][:n], static["causal"][:n] = q_l, kv_l, causal
        static["spans"][: spans.shape[0]] = spans
        for name in LAYERS:
            q, k, v, kc, vc, bt = paged(env, batch, num_blocks, width, seed)
            caches[name][0].copy_(kc)
            caches[name][1].copy_(vc)
            for buf, new in zip(qkv[name], (q, k, v)):
                buf[: batch.total_q].copy_(new[: batch.total_q])
            static["bt"][:n] = bt
        new_rows = sa.plan(batch, sa.LayerMask(), device=dev)  # the last q_len keys of each sequence
        static["slots"][: batch.total_q] = slot_mapping(new_rows, static["bt"][:n], PAGE)

    r = random.Random(7)
    batches = [random_batch(r, env, max_seqs, max_len - 1, max_q=max_q_len) for _ in range(5)]
    load(batches[0], 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    replays = []
    for i, batch in enumerate(batches):
        load(batch, i + 1)
        before = {n: [t.clone() for t in c] for n, c in caches.items()}
        graph.replay()
        torch.cuda.synchronize()
        replayed = {n: o[: batch.total_q].clone() for n, o in outs.items()}
        for name, c in caches.items():  # eager on the same metadata and caches
            for t, b in zip(c, before[name]):
                t.copy_(b)
        eager = step()
        planner.check()
        row = {"seqs": len(batch), "tokens": batch.total_q, "keys": batch.total_k}
        for name, layer in LAYERS.items():
            row[f"{name}_equal_to_eager"] = bool(torch.equal(replayed[name], eager[name][: batch.total_q]))
            hplan = sa.plan(batch, layer, device=dev)
            truth = Truth(
                qkv[name][0][: batch.total_q], *caches[name], hplan, block_table=static["bt"][: len(batch)]
            )
            row[f"{name}_rule"] = truth.check(replayed[name]).as_dict()
        replays.append(row)
        print(f"  graph {kind} replay {i}: {row}", flush=True)
    ok = all(r[f"{n}_equal_to_eager"] and r[f"{n}_rule"]["ok"] for r in replays for n in LAYERS)
    return {"ok": ok, "capacity": planner.capacity.__dict__, "replays": replays}


def check_example(env: Env, report: dict):
    import importlib.util

    spec = importlib.util.spec_from_file_location("paged_engine", ROOT / "examples" / "paged_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["paged_engine"] = module
    spec.loader.exec_module(module)
    steps, worst = module.run(str(env.device))
    return {"ok": True, "steps": steps, "max_error": worst}


def _record(report, name, fn):
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    report[name] = result
    print(f"{name}: {'ok' if result.get('ok') else 'FAILED ' + result.get('error', '')}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = Env(args.device)
    report = environment(args.device)
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:
        report["transformers"] = None
    check_opcheck(env, report)
    _record(report, "compile", lambda: check_compile(env, 20 if env.cuda else 3))
    check_graph(env, report)
    _record(report, "example", lambda: check_example(env, report))
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("ok") is False]
    report["failed"] = failed
    path = result_path(out, "ops", report)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
