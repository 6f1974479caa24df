"""One rank of the tensor-parallel check (tests/test_hf_tensor_parallel.py): load a saved tiny
model (with ``tp_plan="auto"`` under torchrun), run its text attention through spanattn, and save
the logits and greedy tokens of a prompt whose image is wider than the sliding window.

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py MODEL_DIR OUT_FILE [native]

``native`` keeps transformers' own attention (to tell its failures from spanattn's).
"""

import os
import sys

import torch
import transformers

import spanattn.hf

IMG = 5


def main(model_dir: str, out_file: str, native: str = "") -> None:
    tp = {"tp_plan": "auto"} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, **tp)
    if not native:
        spanattn.hf.enable(model.eval())
    ids = torch.tensor([[2, 9, 10] + [IMG] * 16 + [11, 12, 13]])
    types = (ids == IMG).long()
    g = torch.Generator().manual_seed(0)
    if model.config.model_type == "gemma3":
        inputs = {"token_type_ids": types, "pixel_values": torch.randn(1, 3, 16, 16, generator=g)}
    else:  # Gemma 4 takes patches and their (x, y) positions
        xy = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="xy"), -1).reshape(
            1, 64, 2
        )
        inputs = {"mm_token_type_ids": types, "pixel_values": torch.randn(1, 64, 48, generator=g)}
        inputs["image_position_ids"] = xy
    inputs["input_ids"] = ids
    with torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :]
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"logits": logits, "tokens": tokens}, out_file)
    if torch.distributed.is_initialized():  # a clean exit: gloo aborts a process left mid-group
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
