"""The standard steps (docs/design.md section 5), shared by the benchmarks, the demo and the
tests so that every number is measured on the same steps. ``scale`` shrinks token counts for
CPU runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import Batch, LayerMask, Seq

HQ, HKV = 16, 8


@dataclass(frozen=True)
class Scenario:
    id: str
    what: str
    batch: Batch
    layer: LayerMask
    head_dims: tuple[int, ...]
    page_size: int | None = None  # paged decode scenarios read K/V through a block table

    @property
    def decode(self) -> bool:
        return self.page_size is not None


def even_spans(n_tokens: int, n_spans: int, span_len: int) -> list[tuple[int, int]]:
    """Span i starts at ``200 + i * ((n_tokens - 200) // n_spans)`` (docs/design.md section 5)."""
    step = (n_tokens - 200) // n_spans
    return [(200 + i * step, 200 + i * step + span_len - 1) for i in range(n_spans)]


def _lens(seed: int, n: int, low: int, high: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def scenarios(scale: int = 1) -> dict[str, Scenario]:
    """All standard scenarios; token counts divided by ``scale`` (1 = the real sizes)."""
    n = 32768 // scale
    img = even_spans(n, 16, 1120 // scale)
    w = max(1, 1024 // scale)
    s3 = []
    for kv in _lens(1, 8, 3000 // scale, 8191 // scale):
        spans = [(s, s + 280 // scale - 1) for s in range(200 // scale, kv, max(1, 900 // scale))]
        s3.append(Seq(q_len=min(kv, 2048 // scale), kv_len=kv, spans=[sp for sp in spans if sp[1] < kv]))
    s4 = [Seq(q_len=2048 // scale, kv_len=4096 // scale) for _ in range(4)]
    s4 += [Seq(q_len=256 // scale, kv_len=4096 // scale, causal=False) for _ in range(4)]
    d1 = [Seq(q_len=1, kv_len=kv) for kv in _lens(2, 64, 4096 // scale, 32768 // scale)]
    out = [
        Scenario("S0", "plain causal", Batch([Seq(n)]), LayerMask(spans="off"), (128, 256)),
        Scenario(
            "S1",
            "Gemma 4 sliding layer",
            Batch([Seq(n, spans=img)]),
            LayerMask(window=w, spans="clamp"),
            (128, 256),
        ),
        Scenario(
            "S2", "global layer, spans on", Batch([Seq(n, spans=img)]), LayerMask(spans="on"), (128, 256)
        ),
        Scenario("S3", "mixed chunked batch", Batch(s3), LayerMask(window=w, spans="clamp"), (256,)),
        Scenario("S4", "dynamic causal", Batch(s4), LayerMask(spans="off"), (128,)),
        Scenario("S5", "Gemma 4 global, d512", Batch([Seq(n)]), LayerMask(spans="off"), (512,)),
        Scenario("D1", "paged decode", Batch(d1), LayerMask(spans="off"), (128, 256), page_size=16),
    ]
    return {s.id: s for s in out}


def packed_samples(scale: int = 1, seed: int = 2, tokens: int = 32768, samples: int = 16) -> list[Seq]:
    """A padding-free fine-tuning batch: ``samples`` samples of 1k-3.5k tokens (``seed``; their
    lengths beyond 1k shrunk alike to fill ``tokens`` exactly), each with one or two 256-token
    images (the first after a short prompt, a second past its middle), every sample its own
    causal sequence; lengths divided by ``scale``."""
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, 3584 - 1024 + 1, (samples,), generator=g).double()
    lengths = 1024 + (extra * (tokens - 1024 * samples) / extra.sum()).floor().long()
    lengths[-1] += tokens - int(lengths.sum())
    two = torch.rand(samples, generator=g) < 0.5
    img = max(1, 256 // scale)
    seqs = []
    for n, second in zip((lengths // scale).tolist(), two.tolist()):
        starts = [max(1, 32 // scale)] + ([n // 2] if second else [])
        seqs.append(Seq(n, spans=[(s, s + img - 1) for s in starts]))
    return seqs


def training_scenarios(scale: int = 1) -> dict[str, Scenario]:
    """The training steps of docs/design.md section 5 (forward and backward): T0-T2 are S0-S2, T3 a
    packed fine-tuning batch (``packed_samples``) under a clamped 1024-token window (T3) and a
    global layer with spans on (T3g), T5 is S5 (d512)."""
    s = scenarios(scale)
    w = max(1, 1024 // scale)
    batch = Batch(packed_samples(scale))
    like = lambda sid, src, dims: Scenario(sid, s[src].what, s[src].batch, s[src].layer, dims)
    what = "packed fine-tuning batch, 16 samples with images"
    out = [like(f"T{i}", f"S{i}", (128, 256)) for i in range(3)]
    out += [
        Scenario("T3", f"{what}, W=1024 clamp", batch, LayerMask(window=w, spans="clamp"), (128, 256)),
        Scenario("T3g", f"{what}, global, spans on", batch, LayerMask(spans="on"), (128, 256)),
        like("T5", "S5", (512,)),
    ]
    return {x.id: x for x in out}


def video_frames(scale: int = 1, frames: int = 64, frame: int = 256, stamp: int = 16) -> tuple[list, int]:
    """A video prompt: ``frames`` frames of ``frame`` tokens, each after ``stamp`` timestamp text
    tokens, then a 64-token question; ``((start, end, 0) spans, tokens)``, lengths divided by
    ``scale`` (at least 1 token each)."""
    frame, stamp = max(1, frame // scale), max(1, stamp // scale)
    spans = [(i * (frame + stamp) + stamp, (i + 1) * (frame + stamp) - 1, 0) for i in range(frames)]
    return spans, frames * (frame + stamp) + max(1, 64 // scale)


def video_scenarios(scale: int = 1) -> dict[str, Scenario]:
    """Molmo2-style video steps (span groups: every frame sees every other, the timestamps stay
    causal), d128: V1 a global layer (spans on), V2 the same under a 1024-token clamped window
    (video-frame tokens see later frames, earlier ones only within the window). Each has a
    ``-plain`` twin with the same frames as independent spans (no group): the step without
    groups that V1/V2 are measured against per allowed pair. Kept apart from ``scenarios()``:
    FA4 does not run span groups."""
    spans, n = video_frames(scale)
    plain = [(s, e) for s, e, _ in spans]
    w = max(1, 1024 // scale)
    what = "64 frames x 256 + 16-token timestamps"
    layers = {
        "V1": (LayerMask(spans="on"), "global"),
        "V2": (LayerMask(window=w, spans="clamp"), "W=1024 clamp"),
    }
    out = {}
    for sid, (layer, kind) in layers.items():
        out[sid] = Scenario(
            sid, f"video {kind}: {what}, one span group", Batch([Seq(n, spans=spans)]), layer, (128,)
        )
        twin = f"video {kind}: the same frames as independent spans"
        out[f"{sid}-plain"] = Scenario(f"{sid}-plain", twin, Batch([Seq(n, spans=plain)]), layer, (128,))
    return out


def check_step() -> tuple[Batch, dict[str, LayerMask]]:
    """The mixed step the GPU scripts hold every kernel to, with the layer kinds they check it
    under: a 700-query chunk with two images (one past a tile edge), a decode row, a span ending
    on a tile edge, a non-causal canvas and a single token; causal, spans on, clamped and wide
    windows, and W=1."""
    batch = Batch(
        [
            Seq(q_len=700, kv_len=1300, spans=[(150, 449), (1000, 1199)]),
            Seq(q_len=1, kv_len=517),
            Seq(q_len=129, kv_len=129, spans=[(64, 127)]),
            Seq(q_len=200, kv_len=333, causal=False),
            Seq(q_len=1, kv_len=1),
        ]
    )
    layers = {
        "causal": LayerMask(spans="off"),
        "on": LayerMask(spans="on"),
        "W37_clamp": LayerMask(window=37, spans="clamp"),
        "W200_on": LayerMask(window=200, spans="on"),
        "W1": LayerMask(window=1),
    }
    return batch, layers


def group_check_step(m: int = 1) -> tuple[Batch, dict[str, LayerMask]]:
    """A mixed step with span groups that tests and the GPU scripts hold every backend to
    (positions times ``m``; 1 suits the interpreter's 16-token tiles): video frames with text
    between, a chunk after a prefix that ends between a group's spans plus a second group, a
    decode row after a group, a non-causal canvas with one, a plain prompt; under spans on (no
    window and a window narrower than a frame) and clamped."""
    f = lambda *spans: [(a * m, b * m + m - 1, g) for a, b, g in spans]
    batch = Batch(
        [
            Seq(90 * m, spans=f((5, 20, 0), (25, 44, 0), (49, 60, 0), (66, 81, 0))),
            Seq(30 * m, 70 * m, spans=f((10, 25, 0), (40, 55, 0), (60, 65, 1), (68, 69, 1))),
            Seq(1, 40 * m, spans=f((3, 9, 0), (20, 29, 0))),
            Seq(12 * m, causal=False, spans=f((0, 3, 0), (8, 11, 0))),
            Seq(5 * m),
        ]
    )
    layers = {
        "on": LayerMask(spans="on"),
        "W24_clamp": LayerMask(window=24 * m, spans="clamp"),
        "W9_on": LayerMask(window=9 * m, spans="on"),
    }
    return batch, layers


def group_decode_step(m: int = 1) -> Batch:
    """A decode-shaped step (every q_len <= 16: triton's split-KV kernel) with rows inside span
    groups (positions times ``m``): a block ending inside a video frame (the group cut at the
    chunk end), a block at the video's end, a decode row after it, a block whose frame sees the
    next frame, a canvas."""
    f = [(5 * m, 20 * m, 0), (25 * m, 44 * m, 0), (49 * m, 60 * m, 0), (66 * m, 81 * m, 0)]
    return Batch(
        [
            Seq(3, 45 * m, spans=f, prompt_len=90 * m),
            Seq(4, 82 * m, spans=f),
            Seq(1, 97 * m, spans=f),
            Seq(
                12,
                40 * m,
                spans=[(5 * m, 9 * m, 0), (40 * m - 12, 40 * m - 9, 0), (40 * m - 6, 40 * m - 1, 0)],
            ),
            Seq(2, 12 * m, spans=[(0, 3 * m, 0), (12 * m - 4, 12 * m - 1, 0)], causal=False),
        ],
        allow_split_spans=True,
    )
