"""benchmarks/hf_families.py, hf_compiled.py, hf_training.py and gpu_tensor_parallel.py end to end
at toy sizes on CPU: every timed row checked against transformers' own attention, JSON (and PNG)
written."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load_script

pytest.importorskip("transformers")


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_hf_families_tiny(tmp_path, capsys):
    script = load_script("hf_families")
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3,paligemma,pi0", "--sizes", "128"]
    assert script.main(argv + ["--warmup", "0", "--repeats", "1"]) == 0
    assert "[3/3] PI0" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-hf-families-cpu.json")
    data = json.loads(path.read_text())
    assert data["gpu"] is None and data["transformers"] and data["torch"]
    assert {f: c["ok"] for f, c in data["exactness"].items()} == {
        "Gemma 3": True,
        "PaliGemma 2": True,
        "PI0": True,
    }
    ours = {r["family"]: r for r in data["results"] if r["impl"] == "spanattn"}
    assert all(
        r["status"] == "ok" and r["rel_vs_reference"] < 1e-3 and r["speedup_vs_eager"] > 0
        for r in ours.values()
    )
    assert (
        ours["Gemma 3"]["images"] >= 1 and ours["PaliGemma 2"]["reference"] == "eager"
    )  # SDPA has no softcap
    assert path.with_suffix(".png").exists()


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_hf_compiled_tiny(tmp_path, capsys):
    """One stack, one context: eager and compiled generate() under both attentions, and the
    fp32 check that spanattn's greedy tokens equal SDPA's."""
    script = load_script("hf_compiled")
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3", "--sizes", "32", "--new", "4"]
    assert script.main(argv + ["--warmup", "0", "--repeats", "1"]) == 0
    assert "[1/1] Gemma 3" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-hf-compiled-cpu.json")
    data = json.loads(path.read_text())
    assert data["gpu"] is None and data["transformers"] and data["compile_config"]["fullgraph"]
    check = data["exactness"]["Gemma 3"]
    assert check["ok"] and check["fp32_tokens_equal"] and check["spanattn_compiled_tokens_equal_eager"]
    ours = [r for r in data["results"] if r["impl"] == "spanattn"]
    assert len(ours) == 1 and ours[0]["images"] >= 1 and "speedup_decode_compiled" in ours[0]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_tensor_parallel_tiny(tmp_path, capsys):
    """Gemma 3 on one process and on two (gloo): both attentions timed at each world size, and
    spanattn's two-rank hidden states as close to its one-rank ones as SDPA's."""
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
    script = load_script("gpu_tensor_parallel")
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3", "--warmup", "0", "--repeats", "1"]
    assert script.main(argv) == 0
    assert "world 2" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-tensor-parallel-cpu.json")
    data = json.loads(path.read_text())
    assert data["exactness"]["Gemma 3"]["float32"]["ok"] and not data["failed"]
    rows = {(r["ranks"], r["impl"]): r["status"] for r in data["results"]}
    assert rows == {(w, i): "ok" for w in (1, 2) for i in ("sdpa", "spanattn")}


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_hf_training_tiny(tmp_path, capsys):
    """One training step of Gemma 3 under each attention, and a packed batch against the same
    samples padded: spanattn's loss and gradient equal SDPA's, packed or not."""
    load_script("hf_families")  # what the script imports from its folder
    script = load_script("hf_training")
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3", "--sizes", "64", "--samples", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread spinning beside other jobs costs 5x
    try:
        assert script.main(argv + ["--warmup", "0", "--repeats", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "packed spanattn" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-hf-training-cpu.json")
    data = json.loads(path.read_text())["families"]["Gemma 3"]
    rows = {r["impl"]: r for r in data["results"]}
    assert rows["spanattn"]["status"] == rows["sdpa"]["status"] == rows["eager"]["status"] == "ok"
    assert rows["spanattn"]["loss_rel_vs_sdpa"] < 1e-5 and rows["spanattn"]["grad_rel_vs_sdpa"] < 1e-4
    assert rows["spanattn"]["grad_within_rule"] and rows["spanattn"]["grad_rel_vs_truth"] < 1e-5  # fp64 truth
    assert rows["flex_attention"]["status"] == "unsupported"  # no FlexAttention backward on CPU
    assert rows["no_attention"]["status"] == "ok"  # the floor: attention's own time is the rest
    assert rows["spanattn"]["attention_ms"] == rows["spanattn"]["ms"] - rows["no_attention"]["ms"]
    packed = next(r for r in data["packing"] if r["layout"] == "packed")
    assert packed["status"] == "ok" and packed["loss_rel_vs_padded_sdpa"] < 1e-5
    assert packed["row_tokens"] == packed["real_tokens"] < data["packing"][0]["row_tokens"]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_hf_training_times_a_contender_out_of_memory_again_with_checkpointing(tmp_path, monkeypatch):
    load_script("hf_families")
    script = load_script("hf_training")
    real = script.measure

    def measure(family, model, kw, n, impl, *args):  # spanattn "runs out of memory" without checkpointing
        if impl == "spanattn" and not model.is_gradient_checkpointing:
            return {"status": "OOM", "reason": "CUDA out of memory"}
        return real(family, model, kw, n, impl, *args)

    monkeypatch.setattr(script, "measure", measure)
    argv = ["--tiny", "--out", str(tmp_path), "--families", "gemma3", "--sizes", "64", "--samples", "0"]
    assert script.main(argv + ["--warmup", "0", "--repeats", "1"]) == 0
    (path,) = tmp_path.glob("*-hf-training-cpu.json")
    rows = {r["impl"]: r for r in json.loads(path.read_text())["families"]["Gemma 3"]["results"]}
    assert rows["spanattn"]["status"] == "ok" and rows["spanattn"]["checkpointing"] is True
    assert "checkpointing" not in rows["sdpa"] and "attention_ms" in rows["sdpa"]
    assert "attention_ms" not in rows["spanattn"]  # the floor ran without checkpointing
