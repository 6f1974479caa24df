"""The examples run end to end on CPU and check themselves (examples/paged_engine.py compares
every output row with the host plan of the same step; examples/finetune.py holds its packed
spanattn training to SDPA's padded one)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_paged_engine(compile_backend, capsys):
    engine = _load("paged_engine")
    torch._dynamo.reset()
    steps, worst = engine.run("cpu", "reference", compile_backend=compile_backend)
    out = capsys.readouterr().out
    assert steps >= 8 and worst <= 1e-5
    assert "decode" in out and "r2:24" in out  # prefill chunks and decode rows both ran


def test_paged_engine_gives_an_image_wider_than_the_budget_a_step_of_its_own(capsys):
    engine = _load("paged_engine")
    steps, worst = engine.run("cpu", "reference", budget=16)
    out = capsys.readouterr().out
    assert worst <= 1e-5 and "[r0:40]" in out  # the 40-token image, alone in its step
    for line in out.splitlines()[:steps]:
        chunks = [c.split(":")[1] for c in line[line.index("[") + 1 : line.index("]")].split(", ")]
        sizes = [1 if c == "decode" else int(c) for c in chunks]
        assert sum(sizes) <= 16 or len(sizes) == 1, line


def test_schedule_starves_no_request():
    """Two decoding requests take 2 of a 16-token budget every step; a prompt whose first chunk is
    a 15-token image must still run (it waited forever behind the decode rows)."""
    engine = _load("paged_engine")
    image = engine.Request(prompt_len=40, decode_tokens=1, placeholders=[(0, 15)])
    chatty = [engine.Request(prompt_len=4, decode_tokens=50, done=4) for _ in range(2)]
    requests = [*chatty, image]
    for now in range(60):
        step = engine.schedule(requests, 16, now)
        assert step and sum(n for _, n in step) <= max(16, 15)
        for i, n in step:
            requests[i].done += n
        if image.done >= image.prompt_len:
            break
    assert image.done >= image.prompt_len and now <= 5


@pytest.mark.parametrize("trainer", ["transformers", "trl"])
def test_finetune(trainer, tmp_path, capsys):
    """Two optimizer steps of a tiny Gemma 3 on packed rows with images (~2 s on one thread):
    losses and gradients equal to SDPA's on the same samples padded. TRL's SFTTrainer where TRL is
    installed (an optional extra: CI runs transformers' Trainer)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    if trainer == "trl":
        pytest.importorskip("trl")
    finetune = _load("finetune")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = finetune.run(steps=2, trainer=trainer, out=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert result["trainer"] == trainer and len(result["losses"]["spanattn_packed"]) == 2
    assert result["loss_error"] < 1e-5 and result["gradient_error"][0] < 1e-5
    assert max(result["gradient_error"]) < 1e-3  # after an AdamW step the runs' weights differ by rounding
    assert (tmp_path / "finetune.json").exists() and "spanattn_packed step 2/2" in capsys.readouterr().out
