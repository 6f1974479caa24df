"""Fine-tune a vision-language model through spanattn with padding-free packed rows of images.

A tiny random Gemma 3 (or Gemma 4: ``--family gemma4``) learns from synthetic image-text samples
for a few optimizer steps. Each batch's samples are packed into ONE row, as transformers'
``DataCollatorWithFlattening`` packs text (position ids restarting per sample, FlashAttention's
``cu_seq_lens``), plus what that collator drops: the samples' token types and pixel values. Under
``attn_implementation="spanattn"`` every sample of the row is its own sequence with its images
bidirectional: packing and image blocks together, which transformers' attentions and TRL do not
offer (TRL refuses ``packing`` and ``padding_free`` for image datasets).

The same steps run again from the same weights with transformers' SDPA on the samples padded to
the right, the usual way, and the two runs are held together: per-step losses and every
parameter's gradient at each step (before the optimizer uses it).

Trainer: TRL's ``SFTTrainer`` when TRL is installed (``pip install spanattn[trl]``), handed the
packing collator (its own would keep only token ids); else transformers' ``Trainer``.

    python examples/finetune.py                      # CPU (a GPU when there is one), Gemma 3
    python examples/finetune.py --family gemma4 --steps 5 --out /tmp/finetune
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import transformers

import spanattn.hf

IMG, VOCAB = 5, 64
LAYERS = ["sliding_attention", "full_attention"] * 2
TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=LAYERS,
)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
# family: (model class, token-type key, image tokens per image)
FAMILIES = {
    "gemma3": ("Gemma3ForConditionalGeneration", "token_type_ids", 16),
    "gemma4": ("Gemma4ForConditionalGeneration", "mm_token_type_ids", 16),
}


def tiny_model(family: str, attn: str):
    """A random fp32 model (seed 0): images of 16 tokens, a sliding window of 8 (images wider)."""
    torch.manual_seed(0)
    if family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=TEXT, vision_config=dict(VISION, image_size=16, patch_size=4),
            mm_tokens_per_image=16, image_token_id=IMG,
        )  # fmt: skip
    else:
        config = transformers.Gemma4Config(
            text_config=dict(TEXT, global_head_dim=32, use_bidirectional_attention="vision"),
            vision_config=dict(VISION, num_key_value_heads=1, patch_size=4, pooling_kernel_size=2),
            image_token_id=IMG, boi_token_id=6, eoi_token_id=7,
        )  # fmt: skip
    config._attn_implementation = attn
    return getattr(transformers, FAMILIES[family][0])(config)


def pixels(family: str, images: int) -> dict:
    if family == "gemma3":
        return {"pixel_values": torch.randn(images, 3, 16, 16)}
    xy = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).reshape(1, 64, 2)
    return {"pixel_values": torch.randn(images, 64, 48), "image_position_ids": xy.repeat(images, 1, 1)}


def synthetic_samples(family: str, count: int, seed: int = 0) -> list[dict]:
    """Samples of text around one or two images; labels -100 on image tokens (nothing to predict)."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(10, VOCAB, (n,), generator=g).tolist()
    key, per_image = FAMILIES[family][1:]
    out = []
    for _ in range(count):
        images = int(torch.randint(1, 3, (), generator=g))
        ids = [2] + words(int(torch.randint(2, 12, (), generator=g)))
        for _ in range(images):
            ids += [IMG] * per_image + words(int(torch.randint(3, 14, (), generator=g)))
        torch.manual_seed(len(out))
        out.append({
            "input_ids": ids, "labels": [-100 if t == IMG else t for t in ids],
            key: [int(t == IMG) for t in ids], **pixels(family, images),
        })  # fmt: skip
    return out


class PackedCollator:
    """Padding-free: a batch's samples in one row, ``DataCollatorWithFlattening``'s ids, labels
    (-100 at each sample's first token), position ids and ``cu_seq_lens``, plus token types and
    pixel values in sample order."""

    def __init__(self, key: str):
        self.key = key
        self.flatten = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)

    def __call__(self, samples: list[dict]) -> dict:
        batch = self.flatten([{k: s[k] for k in ("input_ids", "labels")} for s in samples])
        batch[self.key] = torch.tensor([sum((s[self.key] for s in samples), [])])
        return batch | images_of(samples)


class PaddedCollator:
    """The reference: one row per sample, padded on the right (labels -100 there)."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, samples: list[dict]) -> dict:
        width = max(len(s["input_ids"]) for s in samples)
        pad = lambda values, fill: torch.tensor([v + [fill] * (width - len(v)) for v in values])
        batch = {
            "input_ids": pad([s["input_ids"] for s in samples], 0),
            "attention_mask": pad([[1] * len(s["input_ids"]) for s in samples], 0),
            "labels": pad([s["labels"] for s in samples], -100),
            self.key: pad([s[self.key] for s in samples], 0),
        }
        return batch | images_of(samples)


def images_of(samples: list[dict]) -> dict:
    keys = [k for k in samples[0] if k in ("pixel_values", "image_position_ids")]
    return {k: torch.cat([torch.as_tensor(s[k]) for s in samples]) for k in keys}  # lists from datasets


class Record(transformers.TrainerCallback):
    """Each step's loss and gradients (as the optimizer gets them), and progress lines."""

    def __init__(self, label: str):
        self.label, self.losses, self.gradients = label, [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        named = model.named_parameters()
        self.gradients.append({n: p.grad.float().cpu().clone() for n, p in named if p.grad is not None})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            step = f"{state.global_step}/{state.max_steps}"
            print(f"  {self.label} step {step}: loss {logs['loss']:.6f}", flush=True)


def trainer_kind(asked: str) -> str:
    if asked != "auto":
        return asked
    try:
        import trl  # noqa: F401
    except ImportError:
        return "transformers"
    return "trl"


def train(model, samples, collator, kind: str, steps: int, bf16: bool, out: Path, label: str) -> Record:
    """``steps`` optimizer steps of 4 samples each (TRL's defaults otherwise: AdamW, a linear
    schedule, clipping at 1, gradient checkpointing), in fp32 unless ``bf16`` (autocast)."""
    record = Record(label)
    common = dict(
        output_dir=str(out / label), per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], remove_unused_columns=False, seed=0,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, bf16=bf16, gradient_checkpointing=True,
    )  # fmt: skip
    if kind == "trl":
        import datasets
        import trl

        samples = datasets.Dataset.from_list(samples)
        args = trl.SFTConfig(**common, packing=False, dataset_kwargs={"skip_prepare_dataset": True})
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=samples, data_collator=collator,
            processing_class=tiny_tokenizer(), callbacks=[record],
        )  # fmt: skip
    else:
        args = transformers.TrainingArguments(**common)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=samples, data_collator=collator, callbacks=[record]
        )
    trainer.train()
    return record


def tiny_tokenizer():
    """A word-level tokenizer over the model's 64 ids (TRL wants one; nothing is tokenized)."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
    )  # fmt: skip


def gradient_error(want: dict, got: dict) -> float:
    """The worst parameter's error relative to its gradient's scale (floored at a thousandth of
    the largest: gradients that are rounding noise around zero)."""
    floor = 1e-3 * max(g.abs().max() for g in want.values())
    return max(((got[n] - g).abs().max() / max(g.abs().max(), floor)).item() for n, g in want.items())


def run(family="gemma3", steps=3, trainer="auto", bf16=False, out: str | Path = "finetune_out") -> dict:
    """Trains a spanattn copy on packed rows and an SDPA copy on padded rows from the same weights
    and batches; returns (and writes to ``out/finetune.json``) losses, times and errors."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kind = trainer_kind(trainer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    samples = synthetic_samples(family, 4 * steps)
    key = FAMILIES[family][1]
    print(f"{family}: {len(samples)} samples, {steps} steps of {kind}'s trainer on {device}", flush=True)
    sdpa = tiny_model(family, "sdpa")
    ours = spanattn.hf.enable(copy.deepcopy(sdpa))
    runs, seconds = {}, {}
    contenders = [("spanattn_packed", ours, PackedCollator(key)), ("sdpa_padded", sdpa, PaddedCollator(key))]
    for label, model, collator in contenders:
        start = time.perf_counter()
        runs[label] = train(model, samples, collator, kind, steps, bf16, out, label)
        seconds[label] = time.perf_counter() - start
    ref, got = runs["sdpa_padded"], runs["spanattn_packed"]
    result = {
        "family": family, "trainer": kind, "device": device, "steps": steps, "bf16": bf16, "seconds": seconds,
        "losses": {label: r.losses for label, r in runs.items()},
        "loss_error": max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses)),
        "gradient_error": [gradient_error(w, g) for w, g in zip(ref.gradients, got.gradients)],
    }  # fmt: skip
    (out / "finetune.json").write_text(json.dumps(result, indent=2))
    per_step = ", ".join(f"{e:.1e}" for e in result["gradient_error"])
    print(
        f"losses within {result['loss_error']:.1e} of SDPA's, gradients within "
        f"{max(result['gradient_error']):.1e} (per step: {per_step}); {out / 'finetune.json'}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trainer", choices=["auto", "trl", "transformers"], default="auto")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (default: fp32)")
    parser.add_argument("--out", default="finetune_out", help="directory for finetune.json")
    run(**vars(parser.parse_args()))


if __name__ == "__main__":
    main()
