"""One training step with images per transformers family: spanattn vs SDPA, eager and flex.

    python benchmarks/hf_training.py --out results/           # GPU: 8k and 32k tokens, bf16
    python benchmarks/hf_training.py --tiny --out /tmp/x     # CPU smoke run at toy sizes, fp32

Stacks at the released layer sizes (hf_families.py's models: text stack of the checkpoint, a few
layers, random weights, a small vocabulary, a tower that never runs; Gemma 3 at 12B's sizes here),
bf16 weights and AdamW. One step is forward, a stand-in loss (the last hidden states along a
random direction, squared: the step's cost is the stack's), backward and ``AdamW.step()``; every
contender trains the same weights from the same state under each attention implementation:

- ``spanattn``: ``spanattn.hf`` (backend auto: triton's kernels, forward and backward);
- ``sdpa``, ``eager``: transformers' own, with their dense masks (eager skipped as 'OOM' where
  its scores would not fit, SDPA's softcap refusal recorded as 'unsupported');
- ``flex_attention``: transformers' FlexAttention path (its BlockMask from the mask functions);
- ``no_attention``: each query's output its own value row (no scores, no mask), the step's floor:
  every contender's ``attention_ms`` is its step time minus this, and ``attention_speedup_vs_*``
  compares those (how far a whole step's speed-up can go is bounded by the rest of the step).

A contender out of memory is timed again with activation checkpointing (``checkpointing: True``
in its row; ``--no-retry-checkpointing`` keeps it out of memory), what its users would do.
Reported per family, size and contender: median step time, tokens/s, peak memory above the
weights and optimizer state, the loss and the first text layer's query-projection gradient
against the reference (SDPA, else eager) in the same dtype and against the truth (the reference
with the same weights in fp32; fp64 for an fp32 stack), spanattn's held to twice the reference's
own error (``grad_within_rule``: deep random stacks amplify rounding, Gemma 4's most); the longest
context each trains
(doubling from the first size until it runs out of memory, ``--longest``); and for Gemma 3 and
Gemma 4 a packed batch (``--samples`` samples of 1k-3.5k tokens with their images in one row:
position ids restarting per sample) against the same samples padded, tokens/s of real tokens and
the loss against SDPA's padded one (the same tokens). spanattn under transformers 5.17 refuses
packed rows with Gemma 3's image blocks: recorded as 'unsupported' with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import hf_families as hf  # this folder: the families' stacks and inputs
import torch

import spanattn.hf
from spanattn.bench.report import environment, result_path

IMPLS = ("spanattn", "sdpa", "eager", "flex_attention")
FLOOR = "no_attention"  # the step without attention's own work: what no attention can beat


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    """Each query's output its own position's value row (GQA's heads repeated): no scores, no
    mask; the projections, norms, MLPs, loss and optimizer as in a real step."""
    out = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return out.transpose(1, 2).contiguous(), None


def register_floor() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(FLOOR, _no_attention)
    AttentionMaskInterface.register(FLOOR, lambda *args, **kwargs: None)


GEMMA3_12B = dict(
    hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    sliding_window=1024, query_pre_attn_scalar=256,
)  # fmt: skip
S, F = hf.S, hf.F
STACKS = [
    dataclasses.replace(hf.FAMILIES[0], source="gemma-3-12b", text=GEMMA3_12B, layers=[S] * 5 + [F]),
    dataclasses.replace(hf.FAMILIES[1], layers=[S] * 3 + [F]),  # Gemma 4 31B, its d512 global layer
    next(f for f in hf.FAMILIES if f.name == "PaliGemma 2"),
    next(f for f in hf.FAMILIES if f.name == "PI0"),
]
PACKED = ("gemma3", "gemma4")


def build(family, args, device, dtype):
    """The family's stack in train mode (``--layers``: its layer pattern cut or repeated to that
    many, ending with a global layer; ``--checkpointing``: activations recomputed in the backward)."""
    if args.layers:
        family = dataclasses.replace(family, layers=(family.layers * args.layers)[-args.layers :])
    model = hf.build(family, args.tiny, device, dtype).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    spanattn.hf.enable(model)
    return family, model


def loss_of(family, model, kw: dict) -> torch.Tensor:
    """The last hidden states along a fixed random direction, squared and averaged over the real
    tokens (their mean square alone is the final norm's: constant)."""
    extra = {} if family.needs == "pi0" else {"use_cache": False}
    hidden = model(**kw, **extra).last_hidden_state.float()
    direction = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(0)).to(hidden.device)
    along = (hidden @ direction).square()
    return along.mean() if "attention_mask" not in kw else along[kw["attention_mask"].bool()].mean()


def probe(model) -> torch.nn.Parameter:
    """The first text layer's query projection: its gradient is compared between contenders."""
    return next(p for n, p in model.named_parameters() if "language_model.layers.0.self_attn.q_proj" in n)


def step(family, model, opt, kw: dict, device) -> tuple[float, float, torch.Tensor]:
    """One optimizer step: ``(seconds, loss, probe gradient)``."""
    hf.sync(device)
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = loss_of(family, model, kw)
    loss.backward()
    opt.step()
    hf.sync(device)
    seconds = time.perf_counter() - start
    grad = probe(model).grad  # AdamW leaves it as it was; None where attention never read the queries
    return seconds, loss.item(), None if grad is None else grad.detach().float().cpu()


def measure(family, model, kw: dict, tokens: int, impl: str, device, warmup: int, repeats: int) -> dict:
    """Median step time of ``impl`` from the same weights and optimizer state each time."""
    hf.set_impl(model, impl)
    if impl == "flex_attention" and device.type != "cuda":  # its mask alone compiles for seconds first
        return {"status": "unsupported", "reason": "torch's FlexAttention has no backward on CPU"}
    if impl == "eager" and device.type == "cuda":
        need = hf.eager_gib(family, model, tokens) * 3  # scores kept for the backward
        if need > 0.8 * torch.cuda.mem_get_info()[0] / 2**30:
            return {"status": "OOM", "reason": f"eager needs ~{need:.0f} GiB per layer"}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        times, first = [], None
        for _ in range(warmup + repeats):
            model.load_state_dict(weights)
            base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            seconds, loss, grad = step(family, model, opt, kw, device)
            times.append(seconds)
            first = first or (loss, grad)
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM", "reason": "CUDA out of memory"}
    except (ValueError, NotImplementedError, RuntimeError) as err:  # an implementation refusing the call
        return {"status": "unsupported", "reason": str(err).splitlines()[0][:200]}
    finally:  # the next contender starts from the same weights, no gradients held
        model.load_state_dict(weights)
        model.zero_grad(set_to_none=True)
        del opt
    ms = 1e3 * statistics.median(times[warmup:])
    res = {"status": "ok", "ms": ms, "tokens_per_s": tokens / ms * 1e3, "loss": first[0], "grad": first[1]}
    if device.type == "cuda":
        res["peak_above_state_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


def truth_gradient(family, model, kw: dict, reference: str, device) -> torch.Tensor | None:
    """The probe's gradient of the same weights and inputs in a wider dtype (fp32 for a bf16
    stack, fp64 for an fp32 one) under the reference implementation: what every contender's
    gradient is held to. None where it does not fit in memory."""
    dtype = model.dtype
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    hf.set_impl(model, reference)
    model.to(wide)  # bf16 -> fp32 -> bf16 keeps every weight's bits
    try:
        model.zero_grad(set_to_none=True)
        wide_kw = {k: v.to(wide) if v.is_floating_point() else v for k, v in kw.items()}
        loss_of(family, model, wide_kw).backward()
        return probe(model).grad.detach().double().cpu().clone()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        model.zero_grad(set_to_none=True)
        model.to(dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def compare(rows: list[dict], reference: str, truth: torch.Tensor | None, dtype: torch.dtype) -> None:
    """Loss and probe-gradient errors against the reference, speed-ups against every peer; with
    ``truth``, each contender's gradient error against it, and for spanattn the rule at stack
    level (docs/design.md): at most twice the reference's own error in the same dtype, plus 1e-2
    in bf16 (1e-6 in fp32). A deep random stack amplifies rounding, so only the reference's own
    error tells a wrong gradient from a chaotic one."""
    by = {r["impl"]: r for r in rows if r["status"] == "ok"}
    grads = {impl: row.pop("grad") for impl, row in by.items()}
    floor = by.pop(FLOOR, None)
    if floor is not None:  # attention's own time: the step's minus the floor's (both checkpointed or not)
        for row in by.values():
            if row.get("checkpointing", False) == floor.get("checkpointing", False):
                row["attention_ms"] = row["ms"] - floor["ms"]
    ref = by.get(reference)
    for impl, row in by.items():
        if truth is not None:
            row["grad_rel_vs_truth"] = hf.rel(grads[impl].double(), truth)
        if ref is not None and row is not ref:
            row["loss_rel_vs_" + reference] = abs(row["loss"] - ref["loss"]) / abs(ref["loss"])
            row["grad_rel_vs_" + reference] = hf.rel(grads[impl], grads[reference])
        for peer in by.values():
            if peer is not row:
                row[f"speedup_vs_{peer['impl']}"] = peer["ms"] / row["ms"]
                if row.get("attention_ms", 0) > 0 and "attention_ms" in peer:
                    row[f"attention_speedup_vs_{peer['impl']}"] = peer["attention_ms"] / row["attention_ms"]
    ours = by.get(spanattn.hf.NAME)
    if truth is not None and ours is not None and ref is not None:
        slack = 1e-6 if dtype == torch.float32 else 1e-2
        ours["grad_within_rule"] = ours["grad_rel_vs_truth"] <= 2 * ref["grad_rel_vs_truth"] + slack


def longest(family, model, impl: str, first: int, limit: int, tiny: bool, device) -> int | None:
    """The longest context (doubling from ``first``, at most ``limit``) ``impl`` trains."""
    best, n = None, first
    while n <= limit:
        kw = hf.inputs(family, model, n, tiny, device)
        if measure(family, model, kw, n, impl, device, 0, 1)["status"] != "ok":
            break
        best, n = n, 2 * n
    return best


def samples_batch(family, model, lengths: list[int], tiny: bool, device) -> tuple[dict, dict]:
    """The same samples packed in one row (position ids restarting) and padded on the right."""
    parts = [hf.inputs(family, model, n, tiny, device) for n in lengths]
    key = next(k for k in parts[0] if k.endswith("token_type_ids"))
    packed = {k: torch.cat([p[k] for p in parts], 1) for k in ("input_ids", key)}
    packed["position_ids"] = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    width = max(lengths)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))
    padded = {k: torch.cat([pad(p[k]) for p in parts]) for k in ("input_ids", key)}
    padded["attention_mask"] = torch.cat([pad(torch.ones_like(p["input_ids"])) for p in parts])
    return packed, padded


def bench_packing(family, model, args, device) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    low, high = (32, 112) if args.tiny else (1024, 3584)
    lengths = torch.randint(low, high + 1, (args.samples,), generator=g).tolist()
    packed, padded = samples_batch(family, model, lengths, args.tiny, device)
    real = sum(lengths)
    rows = []
    for layout, kw, impls in (("padded", padded, ("sdpa", "spanattn")), ("packed", packed, ("spanattn",))):
        for impl in impls:
            res = measure(family, model, kw, real, impl, device, args.warmup, args.repeats)
            res.pop("grad", None)
            if rows and res["status"] == rows[0]["status"] == "ok":  # the same tokens: the same loss
                res["loss_rel_vs_padded_sdpa"] = abs(res["loss"] - rows[0]["loss"]) / abs(rows[0]["loss"])
            rows.append({"family": family.name, "layout": layout, "impl": impl, "samples": len(lengths),
                         "real_tokens": real, "row_tokens": kw["input_ids"].numel(), **res})  # fmt: skip
            print(f"  {layout:6s} {impl:14s} {fmt(res)}", flush=True)
    return rows


def fmt(res: dict) -> str:
    shown = {k: v for k, v in res.items() if k != "grad"}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())


def checkpointed(family, model, kw: dict, n: int, impl: str, device, args) -> dict:
    """``measure`` again with activation checkpointing, for a contender out of memory without
    it (what its users would do): the row says ``checkpointing: True``, or stays out of memory."""
    model.gradient_checkpointing_enable({"use_reentrant": False})
    try:
        res = measure(family, model, kw, n, impl, device, args.warmup, args.repeats)
    finally:
        model.gradient_checkpointing_disable()
    if res["status"] == "ok":
        return {**res, "checkpointing": True}
    return {**res, "reason": f"{res.get('reason', res['status'])} (also with checkpointing)"}


def bench_family(family, args, device, dtype) -> dict:
    family, model = build(family, args, device, dtype)
    reference = hf.reference(family)
    out = {"results": [], "longest": {}, "packing": []}
    for n in args.sizes:
        kw = hf.inputs(family, model, n, args.tiny, device)
        truth = truth_gradient(family, model, kw, reference, device)
        rows = []
        for impl in (*IMPLS, FLOOR):
            res = measure(family, model, kw, n, impl, device, args.warmup, args.repeats)
            # eager's own refusal (its scores alone would not fit one layer) stands with checkpointing
            retry = args.retry_checkpointing and not args.checkpointing and res["status"] == "OOM"
            if retry and not res["reason"].startswith("eager needs"):
                res = checkpointed(family, model, kw, n, impl, device, args)
            rows.append({"family": family.name, "tokens": n, "impl": impl, **res})
            print(f"  {n:6d} {impl:14s} {fmt(res)}", flush=True)
        compare(rows, reference, truth, dtype)
        out["results"] += rows
    if args.longest:
        for impl in IMPLS:
            found = longest(family, model, impl, args.sizes[0], args.longest, args.tiny, device)
            out["longest"][impl] = found
        print(f"  longest context trained: {out['longest']}", flush=True)
    if family.needs in PACKED and args.samples:
        out["packing"] = bench_packing(family, model, args, device)
    del model
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <date>-hf-training-<gpu>.json")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU in fp32 (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="*", help="tokens per step (default 8192 32768; tiny 128)")
    ap.add_argument("--families", help="comma-separated subset of: " + ", ".join(f.needs for f in STACKS))
    ap.add_argument("--layers", type=int, help="layers per stack (default: each stack's pattern, 4-6)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in every stack")
    ap.add_argument(
        "--no-retry-checkpointing",
        dest="retry_checkpointing",
        action="store_false",
        help="keep a contender out of memory as such (default: timed again with checkpointing)",
    )
    ap.add_argument("--longest", type=int, default=None, help="search the longest context up to this")
    ap.add_argument("--samples", type=int, default=16, help="samples of the packed batch (0: none)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import transformers

    register_floor()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.sizes = args.sizes or ([128] if args.tiny else [8192, 32768])
    if args.longest is None and not args.tiny:
        args.longest = 131072
    wanted = args.families.split(",") if args.families else [f.needs for f in STACKS]
    report = {
        "what": "one training step (forward, backward, AdamW) with images: spanattn.hf vs SDPA, eager, flex",
        **environment(device), "transformers": transformers.__version__, "dtype": str(dtype),
        "timing": f"median of {args.repeats} steps after {args.warmup}, each from the same weights and state",
        "checkpointing": args.checkpointing, "layers": args.layers,
        "families": {}, "missing": {},
    }  # fmt: skip
    started = time.perf_counter()
    for i, family in enumerate(f for f in STACKS if f.needs in wanted):
        print(f"[{i + 1}/{len(wanted)}] {family.name} ({family.source})", flush=True)
        if not hasattr(transformers, family.model):
            report["missing"][family.name] = f"not in transformers {transformers.__version__}"
            continue
        report["families"][family.name] = {
            "source": family.source, "text": hf.text_config(family, args.tiny),
            **bench_family(family, args, device, dtype),
        }  # fmt: skip
    report["seconds"] = time.perf_counter() - started
    path = result_path(args.out, "hf-training", report)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} in {report['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
