"""spanattn.hf under torch.compile: transformers' compiled generation with a StaticCache
(``generate(..., cache_implementation="static")`` with a compile config, and a compiled
``model.forward``) on tiny Gemma 3 and Gemma 4 with images and a left-padded row: greedy tokens
equal to transformers' eager attention, one graph per step kind (``fullgraph=True``), spanattn's
op running inside it. First, cheaply, the layout those graphs read (:mod:`spanattn.hf.static`)
run eagerly against transformers on every path it serves.

CPU: aot_eager (dynamo and AOT autograd, no code generation) keeps each compiled generate to a
few seconds; what transformers compiles and why it recompiles is the same under inductor."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import spanattn.hf as sahf
import spanattn.ops

transformers = pytest.importorskip("transformers")
import hf_models as hm  # noqa: E402
from hf_models import one_thread, rel  # noqa: E402, F401

TOL = 1e-5
NEW = 6  # tokens generated: the sliding layers' static buffers (W=8) roll from the first one on
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def models(request):
    """(name, eager fp32, spanattn fp32, eager's greedy output on the static cache)."""
    eager = hm.build(request.param)
    out = eager.generate(**hm.inputs(request.param), cache_implementation="static", **GREEDY)
    return request.param, eager, sahf.enable(copy.deepcopy(eager)), out


def same_generation(theirs, ours) -> None:
    assert torch.equal(ours.sequences, theirs.sequences)
    worst = max(rel(y, x) for x, y in zip(theirs.logits, ours.logits))
    assert worst < TOL, worst


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_static_layout_eagerly(models, cache, monkeypatch):
    """What a compiled forward runs, run eagerly: every layer reads the cache's buffers in place
    under the step's device plan (prefill with images, chunk-free decode, sliding buffers that
    roll, Gemma 4's KV-shared layers on the last position)."""
    name, eager, ours, _ = models
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    kw = hm.inputs(name)
    same_generation(eager.generate(**kw, cache_implementation=cache, **GREEDY),
                    ours.generate(**kw, cache_implementation=cache, **GREEDY))  # fmt: skip


def test_static_layout_triton(models, monkeypatch):
    """The same on the backend a GPU runs (Triton's interpreter on CPU): the prefill kernel over
    the key buffers' packed-row view, the split-KV decode kernel, both from device plans."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    name, eager, _, _ = models
    ours = sahf.enable(copy.deepcopy(eager), backend="triton")
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    kw, short = hm.inputs(name), dict(GREEDY, max_new_tokens=3, min_new_tokens=3)
    same_generation(eager.generate(**kw, cache_implementation="static", **short),
                    ours.generate(**kw, cache_implementation="static", **short))  # fmt: skip


def test_static_layout_chunked_prefill(models, monkeypatch):
    """Two prefill chunks into a StaticCache longer than the prompt (the second chunk's queries
    inside the buffer, past the window, its image's block ids read once) then a decode step."""
    name, eager, ours, _ = models
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    kw = hm.row(name, hm.inputs(name, pixels=False), 0)
    key, ctx = hm.FAMILIES[name][1], 21
    ids, types = kw["input_ids"], kw[key]
    outs = []
    for model in (eager, ours):
        cache = transformers.StaticCache(config=model.config.get_text_config(), max_cache_len=64)
        steps = [
            {"input_ids": ids[:, :ctx], key: types[:, :ctx]},
            {"input_ids": ids[:, ctx:], key: types},
            {"input_ids": ids[:, -1:], key: torch.cat([types, types[:, -1:] * 0], 1)},
        ]
        with torch.no_grad():
            outs.append([model(**s, use_cache=True, **{hm.cache_kwarg(model): cache}).logits for s in steps])
    for theirs, mine in zip(*outs):
        assert rel(mine, theirs) < TOL


def test_static_layout_refuses_what_eager_refuses(models, monkeypatch):
    """A chunk ending inside an image (the whole prompt's token types passed with it): the
    compiled forward raises the host plan's error."""
    name, _, ours, _ = models
    monkeypatch.setattr(sahf.attention, "is_compiling", lambda: True)
    kw = hm.row(name, hm.inputs(name, pixels=False), 0)
    key = hm.FAMILIES[name][1]
    cache = transformers.StaticCache(config=ours.config.get_text_config(), max_cache_len=64)
    with torch.no_grad(), pytest.raises(ValueError, match="allow_split_spans"):
        ours(input_ids=kw["input_ids"][:, :10], **{key: kw[key], hm.cache_kwarg(ours): cache})


def compiled_generate(model, kw, compile_forward: bool):
    """Greedy generation through transformers' compiled path; returns (output, spanattn op
    calls, graphs compiled, dynamo's recompile reasons)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls, real = [], spanattn.ops._forward
    spanattn.ops._forward = lambda args, lse: calls.append(1) or real(args, lse)
    try:
        if compile_forward:  # the model's forward compiled: prefill and decode steps in graphs
            model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
            out = model.generate(**kw, cache_implementation="static", **GREEDY)
        else:  # transformers compiles the decode step itself (on CPU only when asked)
            config = transformers.CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
            config._compile_all_devices = True
            out = model.generate(**kw, cache_implementation="static", compile_config=config, **GREEDY)
    finally:
        spanattn.ops._forward = real
        model.__dict__.pop("forward", None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    reasons = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    torch._dynamo.reset()
    return out, len(calls), graphs, reasons


def layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def test_compiled_generation(models):
    """``generate(..., cache_implementation="static", compile_config=...)``: the prefill runs
    eagerly, every decode step in the compiled graph (``fullgraph=True``: no graph break).
    Graphs: two, as with SDPA. The first decode step specializes on transformers' sliding
    static layers' Python length (``cumulative_length_int``); the second, where it changed,
    compiles it as a symbol, and no later step recompiles: spanattn's masks enter as tensors
    whose shapes the cache fixes."""
    name, _, ours, theirs = models
    out, calls, graphs, reasons = compiled_generate(ours, hm.inputs(name), compile_forward=False)
    same_generation(theirs, out)
    assert calls == layers(ours) * (NEW - 1)  # every decode step's layers, inside the graph
    assert graphs == 2 and reasons and all("cumulative_length_int" in r for r in reasons), reasons


def test_compiled_forward(models):
    """``model.forward = torch.compile(model.forward, fullgraph=True)``: the prefill (images,
    spans read when its mask is built) compiles too. Graphs: the prefill's and the decode
    step's (other inputs: transformers drops the pixels after the prefill), which compiles
    the cache's lengths as symbols at once: no recompile after it. A new prompt length
    recompiles the prefill (its plan's capacity is static metadata of the op)."""
    name, _, ours, theirs = models
    out, calls, graphs, reasons = compiled_generate(ours, hm.inputs(name), compile_forward=True)
    same_generation(theirs, out)
    assert calls == layers(ours) * NEW
    assert graphs == 2 and len(reasons) == 1 and "len(kwargs)" in reasons[0], reasons
