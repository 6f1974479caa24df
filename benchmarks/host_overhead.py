"""Host time per attention call against GPU time, every backend and FA4's own call, on a cached
plan (built and used once before timing), small steps and large.

    python benchmarks/host_overhead.py --out DIR             # GPU: every scenario, ~2 minutes
    python benchmarks/host_overhead.py --out DIR --device cpu  # CPU smoke run, tiny steps
    python benchmarks/host_overhead.py --out DIR --device cpu --profile  # + cProfile of the Python path

Per (scenario, backend), N calls back to back on the same tensors, three rounds (``--rounds``) in
which the backends take turns, medians:
- host_ms: wall time of the N calls / N while the GPU is held busy by a sleep kernel queued
  first, so that no launch waits for the GPU: what the host spends per call.
- gpu_ms: CUDA events around the same N calls (after the sleep): GPU time per call, calls back
  to back with the host far ahead.
- wall_ms: the N calls / N with the GPU idle at the start: max(host, GPU) in practice; ``bound``
  says which side limits.
- python_ms (spanattn backends): host time with every Triton launch replaced by a no-op (the
  checks, dispatch, allocations and argument building); ``launches`` per call.
- plan_ms: ``sa.plan`` of the step, synchronized (host code, one upload, the intervals launch).
- fa4_path (fa4): how its timed calls reached FA4's kernel: "direct" (the compiled function
  recorded on the plan's first call, backends/fa4_direct.py) or "public" (FA4's Python
  interface on every call, where the recording did not fit).
On CPU there is no GPU to overlap: host_ms is the whole call (the Triton interpreter's
execution included), python_ms the path around the launches.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spanattn as sa  # noqa: E402
from spanattn.bench.report import environment, pyplot, result_path  # noqa: E402
from spanattn.bench.timing import rotated  # noqa: E402

HQ, HKV = 16, 8
BACKENDS = ("triton", "fa4", "sdpa", "flex", "reference")


def steps(small: bool) -> dict[str, tuple[sa.Batch, sa.LayerMask]]:
    """Steps from a decode batch and a 512-token prefill (host-bound on an H200) to a 16k
    prefill with images (GPU-bound); ``small``: CPU sizes."""
    s = 16 if small else 1
    g = torch.Generator().manual_seed(0)
    kvs = torch.randint(1024 // s, 4096 // s + 1, (64 // s,), generator=g).tolist()
    n = 16384 // s
    images = [(200 // s + i * (n // 8), 200 // s + i * (n // 8) + 1120 // s - 1) for i in range(8)]
    mixed = [sa.Seq(q_len=2048 // s, kv_len=3000 // s, spans=[(2500 // s, 2779 // s)]) for _ in range(2)]
    mixed += [sa.Seq(q_len=1, kv_len=kv) for kv in kvs[:8]]
    chunks = [sa.Seq(q_len=512 // s, kv_len=1024 // s)] * 2
    flags = chunks + [sa.Seq(q_len=256 // s, kv_len=1024 // s, causal=False)] * 2
    return {
        "decode-64": (sa.Batch([sa.Seq(q_len=1, kv_len=kv) for kv in kvs]), sa.LayerMask()),
        "prefill-512": (sa.Batch([sa.Seq(512 // s)]), sa.LayerMask(spans="off")),
        "prefill-512-image": (
            sa.Batch([sa.Seq(512 // s, spans=[(100 // s, 355 // s)])]),
            sa.LayerMask(window=128 // s, spans="clamp"),
        ),
        "mixed-4k": (sa.Batch(mixed), sa.LayerMask(window=1024 // s, spans="clamp")),
        "chunks-and-canvases": (sa.Batch(flags), sa.LayerMask(spans="off")),  # fa4: a launch per flag
        "prefill-16k-images": (
            sa.Batch([sa.Seq(n, spans=images)]),
            sa.LayerMask(window=1024 // s, spans="clamp"),
        ),
    }


class StubbedLaunches:
    """Every Triton (and Gluon) kernel launch a no-op while inside, counted (compiled kernels
    and the interpreter's alike)."""

    def __enter__(self):
        from triton.runtime import interpreter, jit

        self.count = 0
        kinds = (jit.JITFunction, getattr(interpreter, "InterpretedFunction", None))
        self.real = [(cls, cls.run) for cls in kinds if cls is not None]

        def run(fn, *args, **kwargs):
            self.count += 1

        for cls, _ in self.real:
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, real in self.real:
            cls.run = real


def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def time_round(fn, device, n: int, cycles_per_ms: float | None = None, guess_ms: float = 1.0) -> dict:
    """One round of ``n`` calls: host_ms, gpu_ms, wall_ms per call (CPU: host_ms only)."""
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return {"host_ms": (time.perf_counter() - t0) * 1e3 / n}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(cycles_per_ms * (2 * guess_ms * n + 5)))  # the GPU stays behind
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    out = {"host_ms": (t1 - t0) * 1e3 / n, "gpu_ms": start.elapsed_time(end) / n}
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    out["wall_ms"] = start.elapsed_time(end) / n
    return out


def time_calls(calls: dict, device, n: int, rounds: int = 3, cycles_per_ms: float | None = None) -> dict:
    """Per name in ``calls``: host_ms, gpu_ms, wall_ms per call, medians over ``rounds`` rounds
    in which the calls take turns (the order rotating), so that a slow stretch of the machine
    falls on every contender alike."""
    names = list(calls)
    for fn in calls.values():
        fn()
    seen = {name: [] for name in names}
    guess = dict.fromkeys(names, 1.0)
    for r in range(rounds):
        for name in rotated(names, r):
            seen[name].append(time_round(calls[name], device, n, cycles_per_ms, guess[name]))
            guess[name] = max(seen[name][-1]["host_ms"], 0.01)
    out = {}
    for name, times in seen.items():
        out[name] = {key: statistics.median(t[key] for t in times) for key in times[0]}
        if "gpu_ms" in out[name]:
            out[name]["bound"] = "host" if out[name]["host_ms"] > out[name]["gpu_ms"] else "gpu"
    return out


def plan_ms(batch, layer, device, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sa.plan(batch, layer, device=device)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fa4_own(q, k, v, plan, scale):
    """FA4's own varlen call on the same packed tensors (its causal mask: the host path is what
    is measured here, whatever the step's mask)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    args = dict(cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, causal=True)
    args.update(max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, softmax_scale=scale)
    return lambda: flash_attn_varlen_func(q, k, v, **args)


def fa4_path(plan, q, k) -> str:
    from spanattn.backends import fa4
    from spanattn.backends.fa4_direct import Record

    call = fa4._lowering(plan, q, k)[0]
    records = [r for c in getattr(call, "calls", [call]) for r in c.records.values()]  # a call per flag
    return "+".join(sorted({"direct" if isinstance(r, Record) and r.trusted else "public" for r in records}))


def profile_text(fn, calls: int = 300) -> str:
    with StubbedLaunches():
        fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def run(args):
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float16
    d = 128 if cuda else 32
    n_calls = args.calls or (50 if cuda else 3)
    cpm = _sleep_cycles_per_ms() if cuda else None
    rows, profiles = [], {}
    for name, (batch, layer) in steps(small=not cuda).items():
        plan = sa.plan(batch, layer, device=device)
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(plan.total_q, HQ, d, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(plan.total_k, HKV, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        pms = plan_ms(batch, layer, device)
        print(f"{name}: {plan.total_q} queries, {plan.total_k} keys, plan() {pms:.3f} ms", flush=True)
        calls = {}
        for backend in args.backends:
            if backend == "reference" and plan.total_q > 4096:
                continue  # dense fp32 scores of a 16k step: minutes, and not a serving path
            if not cuda and backend == "triton" and plan.total_q > 64:
                continue  # the interpreter executes every program in Python: minutes
            fn = lambda backend=backend, q=q, k=k, v=v, plan=plan: sa.attention(
                q, k, v, plan, backend=backend
            )
            try:
                fn()
            except (RuntimeError, ValueError, ImportError) as e:
                rows.append({"scenario": name, "backend": backend, "skipped": str(e)[:200]})
                print(f"  {backend:10} skipped: {str(e)[:100]}", flush=True)
                continue
            calls[backend] = fn
        own = fa4_own(q, k, v, plan, d**-0.5) if cuda else None
        if own is not None:
            calls["fa4-own"] = own
        timed = time_calls(calls, device, n_calls, args.rounds, cycles_per_ms=cpm)
        for backend, fn in calls.items():
            row = {"scenario": name, "backend": backend, "total_q": plan.total_q, "plan_ms": pms}
            row.update(timed[backend])
            if backend in BACKENDS:
                try:
                    with StubbedLaunches() as stub:
                        fn()
                        stub.count = 0
                        row["python_ms"] = time_calls({backend: fn}, "cpu", n_calls)[backend]["host_ms"]
                        row["launches"] = stub.count // (3 * n_calls + 1)
                except ImportError:  # no triton: nothing to stub
                    pass
                if args.profile:  # fa4's FA4 launches are real (only Triton's are stubbed)
                    profiles[f"{name}/{backend}"] = profile_text(fn)
            if backend == "fa4":
                row["fa4_path"] = fa4_path(plan, q, k)
            rows.append(row)
            extra = "".join(f" {k} {row[k]:.4f}" for k in ("gpu_ms", "wall_ms", "python_ms") if k in row)
            extra += f" via {row['fa4_path']}" if "fa4_path" in row else ""
            print(f"  {backend:10} host {row['host_ms']:.4f} ms{extra} {row.get('bound', '')}", flush=True)
    return rows, profiles


def write_png(path: Path, meta: dict, rows: list[dict]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if "host_ms" in r]
    cases = list(dict.fromkeys(r["scenario"] for r in ok))
    names = list(dict.fromkeys(r["backend"] for r in ok))
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases) + 1, 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        mine = [r for r in ok if r["scenario"] == case]
        xs = range(len(mine))
        ax.bar(xs, [r["host_ms"] for r in mine], 0.4, label="host")
        if any("gpu_ms" in r for r in mine):
            ax.bar([x + 0.4 for x in xs], [r.get("gpu_ms", 0) for r in mine], 0.4, label="GPU")
        ax.set_xticks([x + 0.2 for x in xs], [r["backend"] for r in mine], rotation=60, fontsize=7)
        ax.set_title(case, fontsize=9)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("ms per call")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"spanattn host time per call: {meta.get('gpu') or 'CPU, tiny steps'}, backends {len(names)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for <date>-host-overhead-<gpu>.json (and .png)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=None, help="calls per round (default 50 on CUDA)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds in which the contenders take turns")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS,
                    help="spanattn backends to time (FA4's own call is timed wherever FA4 runs)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="also cProfile each backend's Python path")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment(args.device)
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    meta["date"] = meta.get("date") or datetime.date.today().isoformat()
    meta.update(rounds=args.rounds, calls=args.calls, backends=args.backends)
    rows, profiles = run(args)
    path = result_path(out, "host-overhead", meta)
    path.write_text(json.dumps({**meta, "rows": rows, "notes": __doc__}, indent=1) + "\n")
    if profiles:
        path.with_name(path.stem + "-profiles.txt").write_text(
            "\n".join(f"== {k}\n{v}" for k, v in profiles.items())
        )
    drew = write_png(path.with_suffix(".png"), meta, rows)
    print(f"wrote {path}" + (" and .png" if drew else ""))


if __name__ == "__main__":
    main()
