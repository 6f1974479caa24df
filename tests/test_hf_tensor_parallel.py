"""spanattn.hf under transformers' tensor parallelism: two CPU processes (gloo) each holding half
of the query and KV heads of a tiny random Gemma 3 / Gemma 4 vision model give the logits and
greedy tokens of one process holding all heads. The plan is built on every rank from the same
token types; attention sees only its rank's heads, so nothing in spanattn changes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
pytest.importorskip("transformers.models.gemma4")

WORKER = Path(__file__).with_name("tp_worker.py")
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8)  # fmt: skip
TEXT["layer_types"] = ["sliding_attention", "full_attention"]
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def build(family: str):
    torch.manual_seed(0)
    if family == "gemma3":
        vision = dict(VISION, image_size=16, patch_size=4)
        cfg = transformers.Gemma3Config(
            text_config=TEXT, vision_config=vision, mm_tokens_per_image=16, image_token_id=5
        )
        return transformers.Gemma3ForConditionalGeneration(cfg)
    text = dict(TEXT, global_head_dim=32, use_bidirectional_attention="vision")
    vision = dict(VISION, num_key_value_heads=1, patch_size=4, pooling_kernel_size=2)
    ids = dict(image_token_id=5, boi_token_id=6, eoi_token_id=7, video_token_id=8, audio_token_id=9)
    return transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, **ids)
    )


def run(model_dir, out, procs: int, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    launch = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1 else []
    )
    cmd = [sys.executable, *launch, str(WORKER), str(model_dir), str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def last_error(done) -> str:
    lines = [x for x in done.stderr.splitlines() if "Error: " in x and "ChildFailedError" not in x]
    return lines[-1].split("]: ")[-1] if lines else done.stderr[-300:]


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_two_ranks_give_one_ranks_answer(family, tmp_path):
    build(family).save_pretrained(tmp_path / "model")
    one = run(tmp_path / "model", tmp_path / "one.pt", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run(tmp_path / "model", tmp_path / "two.pt", 2)
    if two.returncode != 0:
        native = run(tmp_path / "model", tmp_path / "native.pt", 2, "native")
        if native.returncode != 0:  # transformers' own attention fails the same way: not ours
            pytest.skip(
                f"transformers {transformers.__version__} cannot run {family} tensor-parallel on CPU "
                f"with its own attention either: {last_error(native)}"
            )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    rel = ((b["logits"] - a["logits"]).abs().max() / a["logits"].abs().max()).item()
    assert rel < 1e-5, rel
    assert torch.equal(b["tokens"], a["tokens"])
