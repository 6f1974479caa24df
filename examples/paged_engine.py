"""A paged KV cache driven through chunked prefill and decode steps by spanattn's ops, with the
per-step metadata an engine's model runner keeps: query lengths, sequence lengths, block table,
slot mapping and multimodal placeholder positions. An example, not an engine: no model, random
q/k/v per token, a toy scheduler and page allocator.

Each step packs up to ``--budget`` new tokens of three requests (one with an image that no chunk
end may cut, one plain text, one with a non-causal canvas) into buffers of a fixed capacity (the
budget, or the longest image where that is longer: such an image takes a step of its own),
plans two layer kinds (a sliding layer with spans clamped to its window, a global one with
spans on) on the device with :class:`spanattn.DevicePlanner`, writes the new keys into each
layer's paged cache and attends over it. Every output row is checked against the host plan of
the same step over packed keys (the reference backend).

    python examples/paged_engine.py                      # CPU, reference backend
    python examples/paged_engine.py --compile aot_eager  # the step under torch.compile
    python examples/paged_engine.py --device cuda        # GPU: triton, step replayed as a CUDA graph
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

import spanattn as sa

PAGE, HQ, HKV, D = 16, 4, 2, 32
LAYERS = {"sliding": sa.LayerMask(window=24, spans="clamp"), "global": sa.LayerMask(spans="on")}


@dataclass
class Request:
    prompt_len: int
    decode_tokens: int
    placeholders: list = field(default_factory=list)  # (offset, length), as an engine holds them
    causal: bool = True
    done: int = 0  # tokens in the cache
    pages: list = field(default_factory=list)
    waiting_since: int | None = None  # the step that first left it out, while it waits

    @property
    def length(self) -> int:
        return self.prompt_len + self.decode_tokens

    @property
    def spans(self) -> list[tuple[int, int]]:
        return sa.spans_from_placeholders(self.placeholders)

    def next_tokens(self, budget: int) -> int:
        """New tokens of its next step within ``budget``: one decode token, or the longest
        prefill chunk that ends inside no image (sa.max_chunk_end); more than ``budget`` only
        where an image starting at ``done`` is longer than it."""
        if self.done >= self.prompt_len:
            return 1
        return sa.max_chunk_end(self.spans, self.done, min(budget, self.prompt_len - self.done)) - self.done


def schedule(requests, budget: int, now: int = 0) -> list[tuple[int, int]]:
    """(request index, new tokens) of step ``now``: never past the budget, never ending inside an
    image, and never starving a request. Requests that a step left out go first in the next one,
    longest waiting first, then decode rows, then prefill chunks; a chunk longer than the whole
    budget (an image wider than it) runs as a step of its own. So a request left out runs within
    as many steps as there are requests waiting before it."""
    live = [(i, r) for i, r in enumerate(requests) if r.done < r.length]
    first = lambda x: (x[1].waiting_since is None, x[1].waiting_since or 0, x[1].done < x[1].prompt_len, x[0])
    step, left = [], budget
    for i, r in sorted(live, key=first):
        n = r.next_tokens(left or budget)
        if n > budget and not step:  # an image wider than the budget: alone, all of it
            step, left = [(i, n)], 0
        elif n <= left:
            step.append((i, n))
            left -= n
        else:
            r.waiting_since = now if r.waiting_since is None else r.waiting_since
            continue
        r.waiting_since = None
    return step


class Engine:
    def __init__(self, device, backend: str, max_tokens: int, max_seqs: int = 4, num_pages: int = 64):
        self.device, self.backend = torch.device(device), backend
        self.free = list(range(num_pages))[::-1]
        self.max_blocks = 12
        self.planner = sa.DevicePlanner(
            LAYERS, max_seqs=max_seqs, max_tokens=max_tokens, max_kv_len=self.max_blocks * PAGE,
            max_spans=2 * max_seqs, device=device,
        )  # fmt: skip
        self.planner.prepare(backend, head_dim=D, dtype=self.dtype, group=HQ // HKV)
        cache = lambda: torch.zeros(num_pages, PAGE, HKV, D, dtype=self.dtype, device=device)
        self.caches = {name: (cache(), cache()) for name in LAYERS}
        self.truth = {}  # (request, layer) -> every key and value written, for the check

    @property
    def dtype(self):
        return torch.float16 if self.device.type == "cuda" else torch.float32

    def metadata(self, requests, step):
        """What a model runner builds per step on the host, padded to the capacity (so a captured
        graph replays on it), then uploads: q_lens, kv_lens, causal (padding sequences: q_len
        0), spans rows (sequence, start, end; padding: sequence -1), block_table, slot_mapping
        (padding tokens: -1)."""
        cap = self.planner.capacity
        q_lens, kv_lens = torch.zeros(2, cap.max_seqs, dtype=torch.int32)
        causal = torch.ones(cap.max_seqs, dtype=torch.int32)
        spans = torch.full((cap.max_spans, 3), -1, dtype=torch.int32)
        bt = torch.zeros(cap.max_seqs, self.max_blocks, dtype=torch.int32)
        slots = torch.full((cap.max_tokens,), -1, dtype=torch.int64)
        row, span_rows = 0, 0
        for b, (i, n) in enumerate(step):
            r = requests[i]
            while len(r.pages) * PAGE < r.done + n:
                r.pages.append(self.free.pop())
            bt[b, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
            pos = torch.arange(r.done, r.done + n)
            slots[row : row + n] = bt[b, pos // PAGE].long() * PAGE + pos % PAGE
            q_lens[b], kv_lens[b], causal[b] = n, r.done + n, r.causal
            for s, e in r.spans:  # absolute positions, as the placeholders give them
                spans[span_rows] = torch.tensor([b, s, e])
                span_rows += 1
            row += n
        return tuple(x.to(self.device) for x in (q_lens, kv_lens, causal, spans, bt, slots))

    def attend(self, q_lens, kv_lens, causal, spans, bt, slots, qkv):
        """One step on the device: plan every layer kind, then per layer write and attend."""
        plans = self.planner.update(q_lens, kv_lens, causal, spans)
        outs = {}
        for name, (kc, vc) in self.caches.items():
            q, k, v = qkv[name]
            sa.write_kv_cache(k, v, kc, vc, slots)
            outs[name] = sa.attention(q, kc, vc, plans[name], block_table=bt, backend=self.backend)
        return outs

    def new_tokens(self, rows: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        qkv = {}
        for name in LAYERS:
            q = torch.randn(self.planner.capacity.max_tokens, HQ, D, generator=g)
            k, v = torch.randn(2, self.planner.capacity.max_tokens, HKV, D, generator=g)
            q[rows:], k[rows:], v[rows:] = 0, float("nan"), float("nan")  # padding: slot -1, never read
            qkv[name] = tuple(x.to(self.dtype).to(self.device) for x in (q, k, v))
        return qkv

    def check(self, requests, step, qkv, outs) -> float:
        """Outputs against the host plan of the same step over packed keys (reference backend)."""
        batch = sa.Batch(
            [sa.Seq(q_len=n, kv_len=requests[i].done + n, spans=requests[i].spans,
                    causal=requests[i].causal, prompt_len=requests[i].length) for i, n in step]
        )  # fmt: skip
        rows, worst = batch.total_q, 0.0
        for name, layer in LAYERS.items():
            q, k, v = (x[:rows].float().cpu() for x in qkv[name])
            at = 0
            for i, n in step:
                new = (k[at : at + n], v[at : at + n])
                old = self.truth.get((i, name), (k[:0], v[:0]))
                self.truth[i, name] = tuple(torch.cat([a, b]) for a, b in zip(old, new))
                at += n
            kp = torch.cat([self.truth[i, name][0] for i, _ in step])
            vp = torch.cat([self.truth[i, name][1] for i, _ in step])
            want = sa.attention(q, kp, vp, sa.plan(batch, layer), backend="reference")
            worst = max(worst, (outs[name][:rows].float().cpu() - want).abs().max().item())
        return worst


def run(device="cpu", backend=None, budget: int = 48, compile_backend: str | None = None, graph=None):
    """Drive the requests to completion; returns the number of steps and the worst error."""
    backend = backend or ("triton" if torch.device(device).type == "cuda" else "reference")
    requests = [
        Request(prompt_len=90, decode_tokens=5, placeholders=[(20, 40)]),  # an image of 40 tokens
        Request(prompt_len=30, decode_tokens=7),
        Request(prompt_len=24, decode_tokens=0, placeholders=[(4, 20)], causal=False),  # a canvas
    ]
    widest = max(e - s + 1 for r in requests for s, e in r.spans)
    engine = Engine(device, backend, max_tokens=max(budget, widest))  # an image's own step fits
    attend = engine.attend
    if compile_backend:
        attend = torch.compile(attend, fullgraph=True, backend=compile_backend)
    replay = None
    steps, worst, tol = 0, 0.0, 2e-2 if engine.dtype == torch.float16 else 1e-5
    while any(r.done < r.length for r in requests):
        step = schedule(requests, budget, steps)
        meta = engine.metadata(requests, step)
        qkv = engine.new_tokens(sum(n for _, n in step), seed=steps)
        if graph if graph is not None else engine.device.type == "cuda":
            replay = replay or GraphStep(engine, meta, qkv)
            outs = replay(meta, qkv)
        else:
            outs = attend(*meta, qkv)
        err = engine.check(requests, step, qkv, outs)
        engine.planner.check()
        kind = ", ".join(
            f"r{i}:{'decode' if requests[i].done >= requests[i].prompt_len else n}" for i, n in step
        )
        print(f"step {steps:2d} [{kind}] max error {err:.2e}")
        if not err <= tol:
            raise SystemExit(f"step {steps}: error {err} over {tol}")
        for i, n in step:
            requests[i].done += n
        worst, steps = max(worst, err), steps + 1
    return steps, worst


class GraphStep:
    """The whole step (planning of both layer kinds, cache writes, attention) captured once as a
    CUDA graph over static buffers, then replayed on each step's new metadata."""

    def __init__(self, engine, meta, qkv):
        self.meta = [x.clone() for x in meta]
        self.qkv = {n: tuple(x.clone() for x in t) for n, t in qkv.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            engine.attend(*self.meta, self.qkv)  # compile the kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outs = engine.attend(*self.meta, self.qkv)

    def __call__(self, meta, qkv):
        for buf, new in zip(self.meta, meta):
            buf.copy_(new)
        for name, tensors in qkv.items():
            for buf, new in zip(self.qkv[name], tensors):
                buf.copy_(new)
        self.graph.replay()
        return self.outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="default: triton on CUDA, reference on CPU")
    ap.add_argument(
        "--budget", type=int, default=48, help="new tokens per step (an image wider takes a step of its own)"
    )
    ap.add_argument(
        "--compile", default=None, metavar="BACKEND", help="torch.compile the step (e.g. aot_eager)"
    )
    ap.add_argument("--no-graph", action="store_true", help="on CUDA, run the step eagerly")
    args = ap.parse_args(argv)
    graph = False if args.no_graph or args.compile else None
    steps, worst = run(args.device, args.backend, args.budget, args.compile, graph)
    print(f"{steps} steps, max error {worst:.2e}")


if __name__ == "__main__":
    main()
