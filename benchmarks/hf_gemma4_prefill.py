"""Prefill of a Gemma-4-shaped transformers stack with images: spanattn vs transformers' SDPA.

    python benchmarks/hf_gemma4_prefill.py --out results/        # H200: 8k/16k/32k, bf16, triton
    python benchmarks/hf_gemma4_prefill.py --tiny --out /tmp/x   # CPU smoke run at toy sizes

The stack is ``Gemma4Model`` (no vision tower: image tokens are marked by ``mm_token_type_ids``
only, which is all the mask needs) with random weights and Gemma 4 31B's attention shapes:
5 sliding layers (W=1024, head_dim 256, 32 q / 16 kv heads) per global layer (head_dim 512,
4 kv heads, k = v), ``use_bidirectional_attention="vision"``. Images: one of 1120 tokens per
2048 tokens, spread as in scenario S1 (``spanattn.scenarios.even_spans``), so every image is
wider than the window. Both paths run the same weights, prefill filling a DynamicCache.

transformers' path builds dense [N, N] masks per layer kind (``create_masks_for_vision_model``)
and SDPA reads them; spanattn's builds none. Reported per size and path: median prefill time,
peak memory (total and above the weights), and the max |difference| of the last hidden states
against SDPA, or "oom".
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

import spanattn
import spanattn.hf
from spanattn.bench.report import result_path
from spanattn.scenarios import even_spans

REAL = dict(
    hidden=5376,
    intermediate=21504,
    heads=32,
    kv_heads=16,
    global_kv_heads=4,
    head_dim=256,
    global_head_dim=512,
    window=1024,
    image=1120,
    slot=2048,
    sizes=[8192, 16384, 32768],
)
TINY = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, global_kv_heads=1, head_dim=32,
            global_head_dim=64, window=16, image=40, slot=128, sizes=[512, 1024])  # fmt: skip


def build(shape: dict, layers: int, device, dtype):
    import transformers

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    kinds[-1] = "full_attention"  # Gemma 4 ends on a global layer
    text = dict(
        vocab_size=4096,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        num_global_key_value_heads=shape["global_kv_heads"],
        head_dim=shape["head_dim"],
        global_head_dim=shape["global_head_dim"],
        attention_k_eq_v=True,
        sliding_window=shape["window"],
        layer_types=kinds,
        use_bidirectional_attention="vision",
        hidden_size_per_layer_input=0,
        max_position_embeddings=max(shape["sizes"]) * 2,
    )
    cfg = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    cfg.get_text_config()._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a CPU init of 3B params is slow
        model = transformers.Gemma4Model(cfg)
    return model.to(dtype).eval(), kinds


def make_inputs(n: int, shape: dict, device):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(10, 4096, (1, n), generator=g)
    spans = even_spans(n, max(1, n // shape["slot"]), shape["image"])
    types = torch.zeros_like(ids)
    for s, e in spans:
        types[0, s : e + 1] = 1
    return ids.to(device), types.to(device), spans


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill(model, ids, types, device, warmup: int, repeats: int) -> dict:
    """Median prefill time, peak memory, last hidden states (a slice: they are compared)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    try:
        with torch.no_grad():
            for _ in range(warmup + repeats):
                sync(device)
                t = time.perf_counter()
                out = model(input_ids=ids, mm_token_type_ids=types, use_cache=True)
                sync(device)
                times.append(time.perf_counter() - t)
                tail = out.last_hidden_state[0, -64:].float().cpu()
                del out
    except torch.cuda.OutOfMemoryError as err:
        return {"status": "oom", "error": str(err).splitlines()[0]}
    res = {"status": "ok", "prefill_ms": 1e3 * statistics.median(times[warmup:]), "tail": tail}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
        res.update(peak_gib=peak / 2**30, peak_above_weights_gib=(peak - base) / 2**30)
    return res


def check_fp32(model, text_cfg, n, shape, device, tails) -> dict:
    """Random deep stacks amplify rounding, so the bf16 difference between two attention
    implementations says little on its own: rerun both in fp32 (weights upcast exactly) and
    measure each bf16 run against the fp32 SDPA run."""
    ids, types, _ = make_inputs(n, shape, device)
    model.float()
    fp32 = {}
    for impl in ("sdpa", spanattn.hf.NAME):
        text_cfg._attn_implementation = impl
        fp32[impl] = prefill(model, ids, types, device, 0, 1)["tail"]
    truth = fp32["sdpa"]
    err = lambda x: (x - truth).abs().max().item()
    acc = {
        "tokens": n,
        "fp32_spanattn_vs_fp32_sdpa": err(fp32[spanattn.hf.NAME]),
        "bf16_sdpa_vs_fp32_sdpa": err(tails[(n, "sdpa")]),
        "bf16_spanattn_vs_fp32_sdpa": err(tails[(n, spanattn.hf.NAME)]),
        "scale": truth.abs().max().item(),
    }
    print("accuracy (last hidden states, 64 tokens):", acc)
    return acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the JSON (<date>-hf-gemma4-prefill-<gpu>.json)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU in fp32 (smoke test)")
    ap.add_argument("--sizes", type=int, nargs="*", help="prompt lengths (default 8k 16k 32k)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--backend", default=None, help="spanattn backend (default triton; auto with --tiny)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="accuracy at the first size against an fp32 run")
    args = ap.parse_args(argv)
    shape = TINY if args.tiny else REAL
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    backend = args.backend or ("auto" if args.tiny else "triton")
    sizes = args.sizes or shape["sizes"]
    import transformers

    model, kinds = build(shape, args.layers, device, dtype)
    spanattn.hf.enable(model, backend=backend)  # sets the options; the switch is the config
    text_cfg = model.config.get_text_config()
    rows, tails = [], {}
    for n in sizes:
        ids, types, spans = make_inputs(n, shape, device)
        results = {}
        for impl in ("sdpa", spanattn.hf.NAME):
            text_cfg._attn_implementation = impl
            results[impl] = prefill(model, ids, types, device, args.warmup, args.repeats)
        ref, ours = results["sdpa"], results[spanattn.hf.NAME]
        if ref["status"] == ours["status"] == "ok":
            ours["max_abs_diff_vs_sdpa"] = (ours["tail"] - ref["tail"]).abs().max().item()
            ours["sdpa_max_abs"] = ref["tail"].abs().max().item()  # the scale of that difference
        for impl, res in results.items():
            tails[(n, impl)] = res.pop("tail", None)
            rows.append({"tokens": n, "images": len(spans), "impl": impl, **res})
            print(f"{n:6d} tokens {len(spans):3d} images  {impl:9s} " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))  # fmt: skip
    accuracy = check_fp32(model, text_cfg, sizes[0], shape, device, tails) if args.check else None
    if device.type == "cuda" and backend == "triton":  # which prefill kernels the layers ran
        from compiled_kernels import compile_counts

        kernels = {k: n for k, n in compile_counts().items() if k.startswith("attn_fwd")}
        print("prefill kernels compiled:", kernels)
    else:
        kernels = None
    report = {
        "what": "prefill of a Gemma-4-shaped Gemma4Model with image spans: spanattn vs transformers SDPA",
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype),
        "spanattn_backend": backend,
        "layers": kinds,
        "shape": {k: v for k, v in shape.items() if k != "sizes"},
        "timing": f"median of {args.repeats} after {args.warmup} warm-up, use_cache=True (DynamicCache)",
        "results": rows,
        "accuracy": accuracy,
        "prefill_kernels_compiled": kernels,
    }
    path = result_path(args.out, "hf-gemma4-prefill", {"date": report["when"], "gpu": report["device"]})
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
