"""Prefill with images, every transformers family spanattn.hf serves: spanattn vs SDPA and eager.

    python benchmarks/hf_families.py --out results/           # H200: 8k and 32k tokens, bf16
    python benchmarks/hf_families.py --tiny --out /tmp/x     # CPU smoke run at toy sizes, fp32

Each family is its transformers model with its released text stack's layer sizes (head_dim,
GQA, sliding window, softcap, layer-kind pattern) but a few layers, random weights, a small
vocabulary and a minimal vision tower that never runs: image tokens are marked by the inputs
the family's mask reads (token types, or the prefix PI0 builds), which is all the mask needs.
The same model runs under each attention implementation in one process:

- ``spanattn``: ``spanattn.hf`` (backend auto), no dense mask;
- ``sdpa``: transformers' SDPA with its dense [N, N] masks (PaliGemma 2: unsupported, softcap);
- ``eager``: transformers' eager attention, where its [H, N, N] scores fit (else 'OOM', estimated).

Per family and size: median prefill time, peak memory above the weights, and the last hidden
states against the reference (SDPA, else eager). Exactness, same call: at the first size the
reference reruns in fp64 (weights upcast exactly) as the truth, and spanattn and the reference
in fp32; in fp32 and in bf16, spanattn's error against the truth must be at most twice the
reference's own error (docs/design.md section 4's rule, at stack level; see ``exactness``).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import spanattn  # noqa: E402
import spanattn.hf  # noqa: E402
from spanattn.bench.report import environment, result_path  # noqa: E402
from spanattn.hf.families import stack_configs  # noqa: E402

VOCAB, IMG = 4096, 4000


@dataclass
class Family:
    """source: the checkpoint whose text sizes are used; needs: its transformers module; model:
    the transformers class built; text: its text-config fields; layers: the layer kinds built;
    image/slot: one image of ``image`` tokens per ``slot`` tokens (None: one image)."""

    name: str
    source: str
    needs: str
    model: str
    text: dict
    layers: list
    image: int = 0
    slot: int | None = None


S, F = "sliding_attention", "full_attention"
# fmt: off
FAMILIES = [
    Family("Gemma 3", "gemma-3-27b", "gemma3", "Gemma3Model",
           dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                head_dim=128, sliding_window=1024, query_pre_attn_scalar=168),
           [S] * 5 + [F], image=256, slot=1024),
    Family("Gemma 4", "gemma-4-31b", "gemma4", "Gemma4Model",
           dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                num_global_key_value_heads=4, head_dim=256, global_head_dim=512, attention_k_eq_v=True,
                sliding_window=1024, use_bidirectional_attention="vision", hidden_size_per_layer_input=0),
           [S] * 5 + [F], image=1120, slot=2048),
    Family("Gemma 4 unified", "gemma-4-12B (transformers' Gemma4UnifiedTextConfig defaults)",
           "gemma4_unified", "Gemma4UnifiedModel",
           dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
                head_dim=256, global_head_dim=512, sliding_window=1024, use_bidirectional_attention="vision"),
           [S] * 5 + [F], image=1120, slot=2048),
    Family("DiffusionGemma", "diffusiongemma-26B-A4B encoder (transformers' DiffusionGemmaTextConfig "
           "defaults; 8 experts of 1152, top 2: fewer than the checkpoint's)",
           "diffusion_gemma", "DiffusionGemmaEncoderModel",
           dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4,
                head_dim=256, global_head_dim=512, sliding_window=512, use_bidirectional_attention="vision",
                num_experts=8, top_k_experts=2, moe_intermediate_size=1152),
           [S] * 5 + [F], image=1120, slot=2048),
    Family("PaliGemma 2", "paligemma2-10b (Gemma 2 9B)", "paligemma", "PaliGemmaModel",
           dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
                num_key_value_heads=8, head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
           [S, F], image=4096),
    Family("Molmo2", "Molmo2-8B (Qwen3 8B)", "molmo2", "Molmo2Model",
           dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, additional_vocab_size=8),
           [F, F]),
    Family("PI0", "pi0 (PaliGemma 3B's Gemma 2B + the Gemma 300M action expert)", "pi0", "PI0Model",
           dict(model_type="gemma", hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256),
           [F, F]),
]
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16, global_head_dim=32,
            sliding_window=16, moe_intermediate_size=32)
TOWERS = {  # never run: image tokens are marked by their token types only
    "siglip": dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4),
    "gemma4": dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, patch_size=4, pooling_kernel_size=2),
    "molmo2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16),
}
# fmt: on
IDS = dict(image_token_id=IMG, boi_token_id=IMG + 1, eoi_token_id=IMG + 2)


def text_config(family: Family, tiny: bool) -> dict:
    text = dict(
        family.text, vocab_size=VOCAB, num_hidden_layers=len(family.layers), max_position_embeddings=65536
    )
    if tiny:
        kv = max(1, text["num_key_value_heads"] * TINY["num_attention_heads"] // text["num_attention_heads"])
        text.update({k: v for k, v in TINY.items() if k in text}, num_key_value_heads=kv)
        if "num_global_key_value_heads" in text:
            text["num_global_key_value_heads"] = 1
    if "sliding_window" in text:
        text["layer_types"] = family.layers
    return text


def config(family: Family, tiny: bool):
    """The family's transformers config: its text stack, a minimal tower."""
    import transformers as t

    text = text_config(family, tiny)
    siglip = {k: v for k, v in TOWERS["siglip"].items() if k != "model_type"}
    pali = dict(
        vision_config=TOWERS["siglip"],
        image_token_index=IMG,
        vocab_size=VOCAB,
        projection_dim=text["hidden_size"],
        hidden_size=text["hidden_size"],
    )
    gemma4_ids = dict(IDS, video_token_id=IMG + 3, audio_token_id=IMG + 4)
    if family.needs == "pi0":  # the 300M action expert beside PaliGemma 3B's text stack
        small = (
            dict(hidden_size=64, intermediate_size=128)
            if tiny
            else dict(hidden_size=1024, intermediate_size=4096)
        )
        return t.PI0Config(
            vlm_config=dict(pali, model_type="paligemma", text_config=text), dit_config=dict(text, **small)
        )
    return {
        "gemma3": lambda: t.Gemma3Config(
            text_config=text, vision_config=siglip, mm_tokens_per_image=16, image_token_id=IMG
        ),
        "gemma4": lambda: t.Gemma4Config(
            text_config=text, vision_config=None, audio_config=None, **gemma4_ids
        ),
        "gemma4_unified": lambda: t.Gemma4UnifiedConfig(text_config=text, boa_token_id=IMG + 5, **gemma4_ids),
        "diffusion_gemma": lambda: t.DiffusionGemmaConfig(
            text_config=text, vision_config=TOWERS["gemma4"], **IDS
        ),
        "paligemma": lambda: t.PaliGemmaConfig(text_config=text, **pali),
        "molmo2": lambda: t.Molmo2Config(
            text_config=text,
            vision_config=TOWERS["molmo2"],
            image_patch_id=IMG,
            adapter_config=dict(
                TOWERS["molmo2"], text_hidden_size=text["hidden_size"], vision_feature_layer=[-1]
            ),
        ),
    }[family.needs]()


def build(family: Family, tiny: bool, device, dtype):
    import transformers

    cfg = config(family, tiny)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a CPU init of billions of params is slow
        model = getattr(transformers, family.model)(cfg)
    return model.to(dtype).eval()


def image_spans(family: Family, n: int, tiny: bool) -> list[tuple[int, int]]:
    """Where the images sit in an ``n``-token prompt (``--tiny`` shrinks them 32x)."""
    shrink = 32 if tiny else 1
    first = min(200, n // 8)
    if family.slot is None:  # one image: PaliGemma's 4096 tokens, a quarter of Molmo2's prompt
        return [(first, first + min(n // 4, family.image // shrink or n) - 1)]
    count = max(1, n // (family.slot // shrink))
    step = (n - first) // count  # docs/design.md section 5's spread: image i at first + i * step
    return [(first + i * step, first + i * step + family.image // shrink - 1) for i in range(count)]


def inputs(family: Family, model, n: int, tiny: bool, device) -> dict:
    """Forward arguments for an ``n``-token prompt with images."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(10, IMG, (1, n), generator=g)
    if family.needs == "pi0":  # the prefix (images + language) embedded already, then state + actions
        dit = model.config.dit_config.hidden_size
        prefix = torch.randn(1, n, model.config.vlm_config.text_config.hidden_size, generator=g)
        actions = torch.randn(1, model.config.chunk_size + 1, dit, generator=g)
        kw = dict(inputs_embeds=prefix, action_embeds=actions, pixel_values=torch.zeros(1))
        return {k: v.to(device, model.dtype) for k, v in kw.items()}
    types = torch.zeros_like(ids)
    for s, e in image_spans(family, n, tiny):
        types[0, s : e + 1] = 1
        ids[0, s : e + 1] = IMG
    if family.needs == "paligemma":  # the image and the prompt are one bidirectional prefix (type 0)
        types = (torch.arange(n) >= n // 2).long()[None]
    key = "token_type_ids" if family.needs in ("gemma3", "paligemma") else "mm_token_type_ids"
    return {"input_ids": ids.to(device), key: types.to(device)}


def forward(family: Family, model, kw: dict) -> torch.Tensor:
    if family.needs == "diffusion_gemma":  # the encoder prefill with the masks generate() builds
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config.get_text_config())
        ids = kw["input_ids"]
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        embeds = torch.empty(*ids.shape, 0, device=ids.device, dtype=model.dtype)
        masks = model.create_masks_for_generate(
            model.config, embeds, None, cache, pos, kw["mm_token_type_ids"]
        )
        cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(input_ids=ids, attention_mask=masks, position_ids=pos, **{cache_arg: cache})
    else:
        out = model(**kw, use_cache=True)
    return out.last_hidden_state


def set_impl(model, impl: str) -> None:
    for config in stack_configs(type(model), model.config) + [model.config]:
        config._attn_implementation_internal = impl


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def eager_gib(family: Family, model, n: int) -> float:
    """Eager attention's score tensors for one layer: bf16 scores, fp32 softmax, bf16 copy."""
    text = model.config.get_text_config() if family.needs != "pi0" else model.config.vlm_config.text_config
    return text.num_attention_heads * n * n * 8 / 2**30


def run(family: Family, model, n: int, impl: str, device, tiny: bool, warmup: int, repeats: int) -> dict:
    """Median prefill time and peak memory of ``impl``; the hidden states to compare."""
    set_impl(model, impl)
    kw = inputs(family, model, n, tiny, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free = torch.cuda.mem_get_info()[0] / 2**30
        if impl == "eager" and eager_gib(family, model, n) > 0.8 * free:
            return {
                "status": "OOM",
                "reason": f"eager needs ~{eager_gib(family, model, n):.0f} GiB per layer",
            }
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    try:
        with torch.no_grad():
            for _ in range(warmup + repeats):
                sync(device)
                start = time.perf_counter()
                hidden = forward(family, model, kw)
                sync(device)
                times.append(time.perf_counter() - start)
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM", "reason": "CUDA out of memory"}
    except ValueError as err:  # e.g. transformers' SDPA refusing a softcap
        return {"status": "unsupported", "reason": str(err).splitlines()[0][:200]}
    # every 8th token's last hidden state: enough to compare, light to keep for three runs
    res = {
        "status": "ok",
        "ms": 1e3 * statistics.median(times[warmup:]),
        "hidden": hidden[0, ::8].double().cpu(),
    }
    if device.type == "cuda":
        res["peak_above_weights_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def bench_family(family: Family, args, device, dtype) -> tuple[list, dict]:
    model = build(family, args.tiny, device, dtype)
    spanattn.hf.enable(model)  # registers spanattn, options default (backend auto)
    rows, hidden = [], {}
    for n in args.sizes:
        for impl in ("sdpa", "eager", spanattn.hf.NAME):
            res = run(family, model, n, impl, device, args.tiny, args.warmup, args.repeats)
            hidden[(n, impl)] = res.pop("hidden", None)
            images = len(image_spans(family, n, args.tiny)) if family.needs != "pi0" else 0
            rows.append({"family": family.name, "tokens": n, "images": images, "impl": impl, **res})
            print(
                f"  {n:6d} {impl:9s} "
                + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()),
                flush=True,
            )
        ref, ours, timed = reference(family), hidden[(n, spanattn.hf.NAME)], rows[-3:]
        for row in timed:
            if row["impl"] != spanattn.hf.NAME or row["status"] != "ok":
                continue
            row["reference"] = ref
            if hidden[(n, ref)] is not None:
                row["rel_vs_reference"] = rel(ours, hidden[(n, ref)])
            for peer in timed:
                if peer["impl"] != row["impl"] and peer["status"] == "ok":
                    row[f"speedup_vs_{peer['impl']}"] = peer["ms"] / row["ms"]
    check = exactness(family, model, args.sizes[0], hidden, device, args.tiny)
    print(f"  exactness: {check}", flush=True)
    del model
    return rows, check


def reference(family: Family) -> str:
    """What spanattn is checked against: SDPA, or eager where transformers' SDPA has no logit
    softcap (5.24 refuses one, 5.17 drops it silently)."""
    return "eager" if family.text.get("attn_logit_softcapping") else "sdpa"


def exactness(family: Family, model, n: int, hidden: dict, device, tiny: bool) -> dict:
    """The rule of docs/design.md section 4 at stack level, at ``n`` tokens: the truth is the
    reference run in fp64; in fp32 and in the benchmark's dtype, spanattn's error against it must
    be at most twice the reference's own error in the same dtype (plus 1e-6 in fp32, 1e-2 in
    bf16). Random deep stacks
    amplify rounding (an MoE router flips an expert), so a fixed tolerance would not tell a
    wrong mask from a chaotic model; the reference's own error does."""
    ref, ours = reference(family), spanattn.hf.NAME
    dtype = model.dtype
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped_mm has no fp64; the loop computes the same
    model.double()
    truth = run(family, model, n, ref, device, tiny, 0, 1).get("hidden")
    model.float()
    fp32 = {impl: run(family, model, n, impl, device, tiny, 0, 1).get("hidden") for impl in (ref, ours)}
    model.to(dtype)
    if truth is None or None in fp32.values():
        return {"reference": ref, "ok": False, "reason": "an fp64 or fp32 run failed"}
    out = {
        "reference": ref,
        "truth": f"{ref} in fp64",
        "tokens": n,
        "fp32_reference_rel": rel(fp32[ref], truth),
        "fp32_spanattn_rel": rel(fp32[ours], truth),
    }
    ok = out["fp32_spanattn_rel"] <= 2 * out["fp32_reference_rel"] + 1e-6
    if dtype != torch.float32:
        out["bf16_reference_rel"] = rel(hidden[(n, ref)], truth)
        out["bf16_spanattn_rel"] = rel(hidden[(n, ours)], truth)
        ok = ok and out["bf16_spanattn_rel"] <= 2 * out["bf16_reference_rel"] + 1e-2
    out["ok"] = ok
    return out


def plot(rows: list, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speedup = lambda r: r.get("speedup_vs_sdpa", r.get("speedup_vs_eager", 0))
    ours = [r for r in rows if r["impl"] == spanattn.hf.NAME and speedup(r)]
    sizes = sorted({r["tokens"] for r in ours})
    names = list(dict.fromkeys(r["family"] for r in ours))
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2, 3.5))
    width = 0.8 / max(1, len(sizes))
    for i, n in enumerate(sizes):
        vals = [next((speedup(r) for r in ours if r["family"] == f and r["tokens"] == n), 0) for f in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{n} tokens")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_ylabel("prefill speed-up vs SDPA (eager where SDPA cannot)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for <date>-hf-families-<gpu>.json (and .png)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU in fp32 (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="*", help="prompt lengths (default 8192 32768; tiny 256 512)")
    ap.add_argument("--families", help="comma-separated subset of: " + ", ".join(f.needs for f in FAMILIES))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    import transformers

    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.sizes = args.sizes or ([256, 512] if args.tiny else [8192, 32768])
    wanted = args.families.split(",") if args.families else [f.needs for f in FAMILIES]
    rows, checks, missing = [], {}, {}
    started = time.perf_counter()
    for i, family in enumerate(f for f in FAMILIES if f.needs in wanted):
        print(f"[{i + 1}/{len(wanted)}] {family.name} ({family.source})", flush=True)
        if not hasattr(transformers, family.model):
            missing[family.name] = f"not in transformers {transformers.__version__}: carry transformers 5.24"
            print(f"  skipped: {missing[family.name]}", flush=True)
            continue
        family_rows, checks[family.name] = bench_family(family, args, device, dtype)
        rows += family_rows
    report = {
        "what": "prefill with images per transformers family: spanattn.hf (backend auto) vs SDPA and eager",
        **environment(device),
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "timing": f"median of {args.repeats} after {args.warmup} warm-up, use_cache=True (DynamicCache)",
        "families": {
            f.name: {"source": f.source, "layers": f.layers, "text": text_config(f, args.tiny)}
            for f in FAMILIES
            if f.needs in wanted
        },
        "results": rows,
        "exactness": checks,
        "missing": missing,
        "seconds": time.perf_counter() - started,
    }
    path = result_path(args.out, "hf-families", report)
    path.write_text(json.dumps(report, indent=1))
    if any(k.startswith("speedup") for r in rows for k in r) and importlib.util.find_spec("matplotlib"):
        plot(rows, path.with_suffix(".png"))
    print(f"wrote {path} in {report['seconds']:.0f} s", flush=True)
    return 0 if all(c.get("ok") for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
