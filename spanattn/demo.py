"""`spanattn demo`: one Gemma-4-like serving step, every backend of this machine checked against
the fp64 reference, forward and backward (a training step's gradients), the mask drawn, and what
each span mode would have done on the same step."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import backends, viz
from .api import attention
from .oracle import GradTruth, Truth
from .plan import Plan, plan
from .spans import drop_wide_spans
from .spec import Batch, LayerMask, Seq

WINDOW = 64
HQ, HKV = 8, 4


def demo_batch() -> Batch:
    """The step: a chunk of a prompt whose image (160 tokens, wider than the window) started
    before the chunk (its first 28 tokens are already cached), a decode row of a request that
    holds an image, and a bidirectional diffusion canvas after a cached prefix."""
    return Batch(
        [
            Seq(q_len=192, kv_len=320, spans=[(100, 259)]),
            Seq(q_len=1, kv_len=200, spans=[(20, 99)]),
            Seq(q_len=64, kv_len=128, causal=False),
        ]
    )


# Gemma 4: sliding layers clamp spans to the window, global layers ignore them; Gemma 3's global
# layers turn them on (and vLLM's Gemma 3 its sliding layers too: docs/design.md section 2).
LAYERS = {
    "sliding": LayerMask(window=WINDOW, spans="clamp"),
    "global": LayerMask(spans="off"),
    "global-on": LayerMask(spans="on"),
}


@dataclass
class Result:
    layer: str
    backend: str
    dtype: str = "-"
    err: float | None = None
    tol: float | None = None
    ms: float | None = None
    status: str = "PASS"  # PASS, FAIL, or "skipped: why"


def _timed(fn, device: torch.device, reps: int) -> tuple[torch.Tensor, float]:
    """Output and (lower) median time in ms of ``reps`` calls after one untimed warm-up call
    (compilation, autotuning, first-use caches); ``reps=1`` times that single call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if reps > 1:
        fn()
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[(len(times) - 1) // 2] * 1e3


def _skip_reason(name: str, mod, q, p: Plan, asked: bool) -> str | None:
    why = mod.unavailable(q, p, scale=q.shape[-1] ** -0.5, softcap=None, return_lse=False)
    if why is None and name == "triton" and q.device.type == "cpu" and not asked:
        # under TRITON_INTERPRET=1 every program runs in Python: minutes for this step
        why = "TRITON_INTERPRET=1 on CPU is too slow for the demo; ask with --backends triton"
    return why


def check_layer(label: str, p: Plan, q, k, v, names, asked: bool, reps: int, log) -> list[Result]:
    """Run each backend on one plan and apply the rule of docs/design.md section 4:
    ``err <= 2 * err(same-dtype reference vs fp64) + 1e-4``; NaN never passes."""
    truth = Truth(q, k, v, p)
    results = []
    for name in names:
        res = Result(label, name, str(q.dtype).removeprefix("torch."), tol=truth.bound)
        try:
            why = _skip_reason(name, backends.load(name), q, p, asked)
        except Exception as e:  # a backend whose optional dependency fails to import
            why = f"import failed: {type(e).__name__}: {e}"
        if why is not None:
            res.status, res.dtype, res.tol = f"skipped: {why}", "-", None
            results.append(res)
            log(f"  [{label}] {name}: skipped ({why})")
            continue
        try:
            out, res.ms = _timed(lambda name=name: attention(q, k, v, p, backend=name), q.device, reps)
            verdict = truth.check(out)
            res.err = verdict.err
            res.status = "PASS" if verdict.ok else "FAIL"
        except Exception as e:
            res.status = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        results.append(res)
        log(
            f"  [{label}] {name}: {res.status}"
            + (f", max err {res.err:.2e}, {res.ms:.2f} ms" if res.ms else "")
        )
    return results


def check_gradients(label: str, p: Plan, q, k, v, names, asked: bool, reps: int, log) -> list[Result]:
    """dq, dk, dv of each backend that trains the step (an output gradient drawn once) against
    the fp64 truth by the gradient rule (``oracle.GradTruth``), timed forward + backward."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    truth = GradTruth(q, k, v, p, dout)
    results = []
    for name in names:
        res = Result(f"{label} grad", name, str(q.dtype).removeprefix("torch."))
        try:
            mod = backends.load(name)
            if _skip_reason(name, mod, q, p, asked) is not None:
                continue  # its forward's row says why it does not run at all
            why = mod.no_backward(q, p)
        except Exception:  # a backend whose optional dependency fails to import: its forward's row
            continue
        if why is not None:
            res.status, res.dtype = f"skipped: {why}", "-"
            results.append(res)
            continue
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def step(name=name, leaves=leaves):
            return torch.autograd.grad(attention(*leaves, p, backend=name), leaves, dout)

        try:
            grads, res.ms = _timed(step, q.device, reps)
            verdict = truth.check(*grads, rounding_slack=True)
            worst = max((verdict.dq, verdict.dk, verdict.dv), key=lambda x: x.err / x.bound)
            res.err, res.tol = worst.err, worst.bound
            res.status = "PASS" if verdict.ok else "FAIL"
        except Exception as e:
            res.status = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        results.append(res)
        log(f"  [{label}] {name} gradients: {res.status}" + (f", {res.ms:.2f} ms fwd+bwd" if res.ms else ""))
    return results


def table(results: list[Result]) -> str:
    fmt = "{:<15} {:<10} {:<9} {:>10} {:>10} {:>9}  {}"
    lines = [fmt.format("layer", "backend", "dtype", "max err", "tolerance", "time ms", "check")]
    for r in results:
        num = lambda x, f: "-" if x is None else format(x, f)
        lines.append(
            fmt.format(
                r.layer, r.backend, r.dtype, num(r.err, ".2e"), num(r.tol, ".2e"), num(r.ms, ".2f"), r.status
            )
        )
    return "\n".join(lines)


def _pairs_differing(a: Plan, b: Plan) -> int:
    """Size of the symmetric difference of two masks of the same batch, from intervals only."""
    lo_a, hi_a, lo_b, hi_b = (t.long() for t in (a.lo, a.hi, b.lo, b.hi))
    inter = (torch.minimum(hi_a, hi_b) - torch.maximum(lo_a, lo_b) + 1).clamp_min(0)
    return int(((hi_a - lo_a + 1) + (hi_b - lo_b + 1) - 2 * inter).sum())


def mode_plans(batch: Batch, window: int) -> dict[str, tuple[Plan, str]]:
    """The step under each span policy at ``window``, with what that policy means."""
    dropped = Batch([Seq(s.q_len, s.kv_len, drop_wide_spans(s.spans, window), s.causal) for s in batch.seqs])
    gone = [
        f"[{a},{b}]" for s in batch.seqs for a, b in s.spans if (a, b) not in drop_wide_spans(s.spans, window)
    ]
    layer = lambda mode: LayerMask(window=window, spans=mode)
    return {
        "clamp": (
            plan(batch, layer("clamp")),
            "Gemma 4 sliding, transformers' Gemma 3 sliding: image both ways, never more than W-1 back",
        ),
        "on": (
            plan(batch, layer("on")),
            "vLLM's Gemma 3 sliding: image queries see their whole image, even beyond W",
        ),
        "off": (plan(batch, layer("off")), "spans ignored: image tokens never see later image tokens"),
        "on+drop-wide": (
            plan(dropped, layer("on")),
            f"vLLM's old policy: spans wider than W={window} dropped ({', '.join(gone) or 'none'}): "
            "those images silently became causal",
        ),
    }


def mode_report(batch: Batch, window: int) -> str:
    """What off / on / clamp / vLLM's old drop-wide policy allow on this step at ``window``."""
    modes = mode_plans(batch, window)
    clamp = modes["clamp"][0]
    out = [
        f"What each span mode allows on this step (window={window}; pairs counted from the intervals):",
        f"  {'mode':<13} {'allowed pairs':>13} {'differ vs clamp':>15}  meaning",
    ]
    for name, (p, meaning) in modes.items():
        out.append(f"  {name:<13} {p.allowed_pairs():>13,} {_pairs_differing(p, clamp):>15,}  {meaning}")
    if _pairs_differing(modes["on+drop-wide"][0], modes["off"][0]) == 0:
        out.append(
            "  -> every image here is wider than W: drop-wide equals 'off', no bidirectional image attention"
        )
    off_g, on_g = plan(batch, LayerMask(spans="off")), plan(batch, LayerMask(spans="on"))
    gain = _pairs_differing(on_g, off_g)
    out.append(
        f"  global layer (no window): off {off_g.allowed_pairs():,} pairs (Gemma 4), "
        f"on {on_g.allowed_pairs():,}"
    )
    out.append(f"    (Gemma 3, spans on; +{gain:,}: image queries also see the later tokens of their image)")
    return "\n".join(out)


def run(
    device=None, dtype=None, out_dir="spanattn-out", names=None, head_dim=128, seed=0, reps=None, log=print
) -> int:
    """The whole demo; returns the process exit code (1 if any backend fails the check).
    ``reps``: timed calls per backend and layer (default 10 on CUDA, 2 on CPU)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    asked = names is not None
    reps = reps or (10 if device.type == "cuda" else 2)
    if reps < 1 or head_dim < 1:
        raise ValueError(f"--reps and --head-dim must be >= 1, got {reps} and {head_dim}")
    names = list(names or backends.BACKENDS)
    unknown = [n for n in names if n not in backends.BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; registered: {', '.join(backends.BACKENDS)}")
    batch = demo_batch()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(n, h, head_dim, generator=g).to(device, dtype)
        for n, h in ((batch.total_q, HQ), (batch.total_k, HKV), (batch.total_k, HKV))
    )
    log(
        f"spanattn demo on {device} ({str(dtype).removeprefix('torch.')}), Hq={HQ}, Hkv={HKV}, "
        f"head_dim={head_dim}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, pictures = [], []
    for label, layer in LAYERS.items():
        plan(batch, layer, device=device)  # the first call on a device pays its start-up; time the next
        t0 = time.perf_counter()
        p = plan(batch, layer, device=device)
        log(f"[{label}] {layer}: planned in {(time.perf_counter() - t0) * 1e3:.2f} ms")
        if label == "sliding":
            log(p.describe())
        with warnings.catch_warnings():
            # eager FlexAttention on CPU warns that it is unfused; its time in the table says so
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            results += check_layer(label, p, q, k, v, names, asked, reps, log)
            results += check_gradients(label, p, q, k, v, names, asked, reps, log)
        pictures.append(viz.draw(p, out_dir / f"demo-{label}.png", title=f"spanattn demo: {label} layer"))
        log(f"[{label}] wrote {pictures[-1]}")
    modes = {name: p for name, (p, _) in mode_plans(batch, WINDOW).items()}
    title = f"spanattn demo: the chunk under each span policy (window={WINDOW})"
    pictures.append(viz.compare(modes, out_dir / "demo-modes.png", seq=0, title=title))
    log(f"[modes] wrote {pictures[-1]}")
    log("")
    log(table(results))
    log("")
    log(mode_report(batch, WINDOW))
    log("")
    log("pictures: " + ", ".join(pictures))
    failed = [r for r in results if r.status.startswith("FAIL")]
    log(
        f"{len(failed)} failed, {sum(r.status == 'PASS' for r in results)} passed, "
        f"{sum(r.status.startswith('skipped') for r in results)} skipped"
    )
    return 1 if failed else 0
