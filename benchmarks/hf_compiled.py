"""transformers' generate() with a StaticCache, compiled and eager: spanattn vs SDPA.

    python benchmarks/hf_compiled.py --out results/           # H200: 8k and 32k context, bf16
    python benchmarks/hf_compiled.py --tiny --out /tmp/x     # CPU smoke run at toy sizes, fp32

Stacks: Gemma 3 and Gemma 4 as benchmarks/hf_families.py builds them (their released text
stacks' layer sizes: head_dim, GQA, sliding window, softcap, layer kinds; 6 layers, random
weights, a small vocabulary, images marked by their token types: the towers never run), as the
``...ForConditionalGeneration`` class that generate() drives. Per stack, context and attention
(spanattn.hf's ``attn_implementation="spanattn"``, or transformers' SDPA), greedy generate() of
``--new`` tokens, batch 1, into ONE StaticCache of ``largest context + new`` slots (a server
sizes its static cache for its longest request; one compiled graph then serves every context:
SDPA attends over the whole buffer, spanattn over the filled keys):

- eager: ``disable_compile=True``;
- compiled: ``compile_config=CompileConfig(fullgraph=True)``, transformers' compiled decode step
  (inductor, ``mode="reduce-overhead"``: CUDA graphs); the prefill runs eagerly in both.

Times are medians: prefill = generate() of one token; decode tokens/s = new / (generate() of
new + 1 tokens - prefill); compile = the first compiled call's time above a steady one.

Exactness, same call, at the first context: the stack rerun in fp32, eager, where spanattn's
greedy tokens must equal SDPA's and its logits agree within 1e-3; every bf16 run's logits
against fp32 SDPA's, over the steps whose tokens agree with it: spanattn's error at most twice
SDPA's in the same mode plus 1e-2 (docs/design.md section 4's rule at stack level); whether
each compiled run's tokens equal its eager run's is recorded.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import hf_families as hff  # noqa: E402

import spanattn.hf  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402

MODELS = {"gemma3": "Gemma3ForConditionalGeneration", "gemma4": "Gemma4ForConditionalGeneration"}
IMPLS = ("sdpa", spanattn.hf.NAME)
# spanattn's row against SDPA's: (name, column, higher is better)
SPEEDUPS = (("prefill", "prefill_ms", False), ("decode_eager", "decode_eager_tok_s", True),
            ("decode_compiled", "decode_compiled_tok_s", True))  # fmt: skip


def build(family, tiny: bool, device, dtype):
    import transformers

    cfg = hff.config(family, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, MODELS[family.needs])(cfg)
    model = spanattn.hf.enable(model.to(dtype).eval())
    model.generation_config.pad_token_id = 0
    return model


def prompt(family, model, n: int, tiny: bool, device) -> dict:
    kw = hff.inputs(family, model, n, tiny, device)
    return dict(kw, attention_mask=torch.ones_like(kw["input_ids"]))


def static_cache(model, length: int):
    from transformers import StaticCache

    return StaticCache(config=model.config.get_text_config(), max_cache_len=length)


def generate(model, kw: dict, cache, new: int, compiled, logits: bool = False):
    """Greedy generate() of ``new`` tokens into ``cache`` (emptied first); compiled: a
    CompileConfig, or None for eager."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache.reset()
    opts = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, **{name: cache})
    opts.update(compile_config=compiled) if compiled else opts.update(disable_compile=True)
    if logits:
        opts.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(**kw, **opts)


def timed(fn, device, warmup: int, repeats: int) -> tuple[float, float]:
    """(median seconds of the repeats, seconds of the first call)."""
    times = []
    for _ in range(warmup + repeats):
        hff.sync(device)
        start = time.perf_counter()
        fn()
        hff.sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), times[0]


def compile_config(args):
    from transformers import CompileConfig

    if args.tiny:  # CPU: no code generation, and transformers compiles on CPU only when asked
        config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
        config._compile_all_devices = True
        return config
    return CompileConfig(fullgraph=True)


def measure(model, kw: dict, cache, compiled, args, device) -> dict:
    """One attention at one context: prefill, eager and compiled decode."""
    run = lambda new, mode: lambda: generate(model, kw, cache, new, mode)
    prefill, _ = timed(run(1, None), device, args.warmup, args.repeats)
    eager, _ = timed(run(args.new + 1, None), device, args.warmup, args.repeats)
    row = {"prefill_ms": 1e3 * prefill, "decode_eager_tok_s": args.new / (eager - prefill)}
    try:
        fast, first = timed(run(args.new + 1, compiled), device, max(1, args.warmup), args.repeats)
    except Exception as err:  # recorded, and the other rows still run
        return dict(row, status="compiled run failed", reason=f"{type(err).__name__}: {str(err)[:400]}")
    row.update(decode_compiled_tok_s=args.new / (fast - prefill), first_compiled_call_s=first)
    return dict(row, compile_s=first - fast, status="ok")


def bench_family(family, args, device, dtype, started: float) -> tuple[list, dict]:
    model = build(family, args.tiny, device, dtype)
    cache = static_cache(model, max(args.sizes) + args.new + 1)
    compiled = compile_config(args)
    rows, outs = [], {}
    for impl in IMPLS:
        hff.set_impl(model, impl)
        torch._dynamo.reset()
        for n in args.sizes:
            kw = prompt(family, model, n, args.tiny, device)
            row = {"family": family.name, "tokens": n, "images": len(hff.image_spans(family, n, args.tiny)),
                   "impl": impl, **measure(model, kw, cache, compiled, args, device)}  # fmt: skip
            rows.append(row)
            shown = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float))
            print(f"  {n:6d} {impl:9s} {shown} [{row['status']}] at {time.perf_counter() - started:.0f} s",
                  flush=True)  # fmt: skip
            if n == args.sizes[0]:
                for mode in ("eager", "compiled") if row["status"] == "ok" else ("eager",):
                    outs[impl, mode] = generate(
                        model, kw, cache, args.new + 1, compiled if mode == "compiled" else None, logits=True
                    )
    for n in args.sizes:
        theirs, ours = ({r["impl"]: r for r in rows if r["tokens"] == n}[i] for i in IMPLS)
        for name, key, higher in SPEEDUPS:
            if key in theirs and key in ours:
                ours[f"speedup_{name}"] = ours[key] / theirs[key] if higher else theirs[key] / ours[key]
    torch._dynamo.reset()
    check = exactness(model, prompt(family, model, args.sizes[0], args.tiny, device), outs, args)
    check["ok"] &= all(r["status"] == "ok" for r in rows)
    print(f"  exactness: {check}", flush=True)
    return rows, check


def agreeing_error(run, truth) -> tuple[float, int]:
    """Largest relative logit error of ``run`` against ``truth`` over the steps whose inputs
    agree (every earlier generated token equal), and how many steps that is."""
    new = len(truth.logits)
    same = (run.sequences[0, -new:] == truth.sequences[0, -new:]).int().cumprod(0).sum().item()
    steps = min(new, same + 1)
    err = max(hff.rel(run.logits[t].float().cpu(), truth.logits[t].float().cpu()) for t in range(steps))
    return err, steps


def exactness(model, kw: dict, outs: dict, args) -> dict:
    """fp32 eager reruns of both attentions; every bf16 run against fp32 SDPA."""
    if model.dtype != torch.float32:
        model.float()
    cache = static_cache(model, kw["input_ids"].shape[1] + args.new + 1)
    fp32 = {}
    for impl in IMPLS:
        hff.set_impl(model, impl)
        fp32[impl] = generate(model, kw, cache, args.new + 1, None, logits=True)
    truth, ours = fp32["sdpa"], fp32[spanattn.hf.NAME]
    check = {
        "tokens": kw["input_ids"].shape[1],
        "fp32_tokens_equal": torch.equal(ours.sequences, truth.sequences),
        "fp32_rel": agreeing_error(ours, truth)[0],
    }
    ok = check["fp32_tokens_equal"] and check["fp32_rel"] < 1e-3
    if not args.tiny:  # the timed runs were bf16
        for mode in ("eager", "compiled"):
            if any((impl, mode) not in outs for impl in IMPLS):
                continue
            errs = {impl: agreeing_error(outs[impl, mode], truth) for impl in IMPLS}
            check[mode] = {f"{impl}_rel": e for impl, (e, _) in errs.items()}
            check[mode]["steps"] = {impl: s for impl, (_, s) in errs.items()}
            ok &= errs[spanattn.hf.NAME][0] <= 2 * errs["sdpa"][0] + 1e-2
    for impl in IMPLS:
        if (impl, "compiled") in outs:
            same = torch.equal(outs[impl, "compiled"].sequences, outs[impl, "eager"].sequences)
            check[f"{impl}_compiled_tokens_equal_eager"] = same
    check["ok"] = bool(ok)
    return check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <date>-hf-compiled-<gpu>.json")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU in fp32, aot_eager (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="*", help="contexts (default 8192 32768; tiny 64)")
    ap.add_argument("--families", default="gemma3,gemma4", help="comma-separated subset of gemma3,gemma4")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per call (default 32)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    import transformers

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.sizes = args.sizes or ([64] if args.tiny else [8192, 32768])
    wanted = args.families.split(",")
    families = [f for f in hff.FAMILIES if f.needs in wanted and f.needs in MODELS]
    rows, checks, started = [], {}, time.perf_counter()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}, {dtype}, "
          f"contexts {args.sizes}, {args.new} new tokens", flush=True)  # fmt: skip
    for i, family in enumerate(families):
        print(f"[{i + 1}/{len(families)}] {family.name} ({family.source})", flush=True)
        family_rows, checks[family.name] = bench_family(family, args, device, dtype, started)
        rows += family_rows
    report = {
        "what": "generate() with a StaticCache, transformers' compiled decode step and eager: "
        "spanattn.hf (backend auto) vs SDPA, batch 1, images in the prompt",
        **environment(device),
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "cache": f"one StaticCache of {max(args.sizes) + args.new + 1} slots for every context",
        "compile_config": {k: v for k, v in compile_config(args).to_dict().items() if k != "options"},
        "timing": f"median of {args.repeats} after {args.warmup} warm-up; prefill = generate() of 1 "
        f"token; decode tokens/s = {args.new} / (generate() of {args.new + 1} tokens - prefill)",
        "families": {
            f.name: {"source": f.source, "layers": f.layers, "text": hff.text_config(f, args.tiny)}
            for f in families
        },  # fmt: skip
        "results": rows,
        "exactness": checks,
        "seconds": time.perf_counter() - started,
    }
    path = result_path(args.out, "hf-compiled", report)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} in {report['seconds']:.0f} s", flush=True)
    return 0 if all(c.get("ok") for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
