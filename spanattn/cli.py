"""The `spanattn` command: `show` draws a described step's mask, `demo` runs the built-in
Gemma-4-like step on every backend of this machine, `bench` hands over to spanattn.bench."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .spec import SPAN_MODES, Batch, LayerMask, Seq

SEQ_KEYS = {"q": "q_len", "kv": "kv_len", "spans": "spans", "causal": "causal", "prompt": "prompt_len"}
TINY = "tiny"  # a step small enough to read as ASCII
# spanattn's errors name the library's argument; say which option of ours sets it
FLAGS = {
    "Seq.q_len": "--q-len / q=",
    "Seq.kv_len": "--kv-len / kv=",
    "Seq.prompt_len": "prompt=",
    "Seq.spans": "--spans / spans=",
    "Seq.causal": "--non-causal / causal=",
    "LayerMask.window": "--window",
    "LayerMask.spans": "--mode",
    "allow_split_spans": "--allow-split-spans",
}


def _presets() -> dict[str, str]:
    from .scenarios import scenarios

    names = {
        "gemma4-sliding": "the demo step, Gemma 4 sliding layer (window 64, spans clamp)",
        "gemma4-global": "the demo step, Gemma 4 global layer (no window, spans off)",
        "gemma3-global": "the demo step, Gemma 3 global layer (no window, spans on)",
        TINY: "8 queries after 4 cached keys, a 5-token image, window 4, clamp",
    }
    names.update({k: f"standard scenario: {s.what}" for k, s in scenarios().items()})
    return names


def _preset(name: str) -> tuple[Batch, LayerMask]:
    from . import demo
    from .scenarios import scenarios

    if name == TINY:
        return Batch([Seq(q_len=8, kv_len=12, spans=[(3, 7)])]), LayerMask(window=4, spans="clamp")
    if name.startswith("gemma"):
        layer = {"gemma4-sliding": "sliding", "gemma4-global": "global", "gemma3-global": "global-on"}[name]
        return demo.demo_batch(), demo.LAYERS[layer]
    sc = scenarios()[name]
    return sc.batch, sc.layer


def _span(text: str) -> tuple[int, int]:
    a, sep, b = text.replace(":", "-").partition("-")
    if not sep:
        raise ValueError(f"span {text!r} must be START-END (inclusive absolute positions)")
    return int(a), int(b)


def _seq(text: str) -> dict:
    """``q=64,kv=96,spans=40-79,90-99,causal=0`` -> Seq keyword arguments; a part without ``=``
    continues the span list before it."""
    kw, last = {}, None
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep and last == "spans":
            kw["spans"] += [_span(s) for s in part.split("+")]
            continue
        if key not in SEQ_KEYS:
            raise ValueError(f"unknown key {key!r} in {text!r}; use {', '.join(SEQ_KEYS)}")
        last, name = key, SEQ_KEYS[key]
        if name == "spans":
            kw[name] = [_span(s) for s in value.split("+") if s]
        elif name == "causal":
            kw[name] = value.lower() in ("1", "true", "yes")
        else:
            kw[name] = int(value)
    if "q_len" not in kw:
        raise ValueError(f"{text!r} needs q=<q_len>")
    return kw


def _seq_arg(text: str) -> dict:
    try:
        return _seq(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spans_arg(text: str) -> list[tuple[int, int]]:
    try:
        return [_span(s) for s in text.split(",") if s]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _window_arg(text: str):
    if text == "keep":  # the default: keep the preset's window (none without a preset)
        return text
    if text.lower() in ("none", "inf"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a window: give an int or 'none'") from None


def _step(args) -> tuple[Batch, LayerMask]:
    """The batch and layer the `show` arguments describe; spanattn's own validation decides."""
    if args.preset:
        batch, layer = _preset(args.preset)
    else:
        if args.seq and args.q_len is not None:
            raise ValueError("give either --seq entries or --q-len/--kv-len/--spans, not both")
        if not args.seq and args.q_len is None:
            raise ValueError("describe a step: --q-len N [--kv-len M --spans S-E], --seq ..., or --preset")
        single = dict(
            q_len=args.q_len,
            kv_len=args.kv_len,
            spans=args.spans,
            causal=not args.non_causal,
            prompt_len=args.prompt_len,
        )
        seqs = []
        for i, kw in enumerate(args.seq or [single]):
            try:
                seqs.append(Seq(**kw))
            except (ValueError, TypeError) as e:
                raise type(e)(f"--seq {i}: {e}" if args.seq else str(e)) from None
        batch, layer = Batch(seqs, allow_split_spans=args.allow_split_spans), LayerMask()
    return batch, LayerMask(
        window=layer.window if args.window == "keep" else args.window,
        spans=args.mode or layer.spans,
        noncausal_window=args.noncausal_window or layer.noncausal_window,
    )


def cmd_show(args) -> int:
    from . import viz
    from .plan import plan

    try:
        batch, layer = _step(args)
        p = plan(batch, layer)
        if args.draw_seq is not None and not 0 <= args.draw_seq < p.num_seqs:
            raise ValueError(f"--draw-seq must be in [0, {p.num_seqs}), got {args.draw_seq}")
    except (ValueError, TypeError) as e:
        named = [(str(e).find(name), flag) for name, flag in FLAGS.items() if name in str(e)]
        hint = f" [{min(named)[1]}]" if named else ""  # the argument the message names first
        print(f"spanattn show: error: {e}{hint}", file=sys.stderr)
        return 2
    print(p.describe())
    too_big = []
    for i in range(p.num_seqs) if args.draw_seq is None else [args.draw_seq]:
        s = p.batch.seqs[i]
        if s.q_len > viz.ASCII_MAX_ROWS or s.kv_len > viz.ASCII_MAX_KEYS:
            too_big.append(str(i))
            continue
        print()
        print(viz.ascii(p, i))
    if too_big:
        which = "any sequence" if len(too_big) == p.num_seqs else "seq " + ", ".join(too_big)
        limit = f"{viz.ASCII_MAX_ROWS} queries x {viz.ASCII_MAX_KEYS} keys"
        print(f"\n(no ASCII for {which}: larger than {limit}; see the PNG)")
    if not args.no_png:
        out = Path(args.out) if args.out else Path(args.out_dir) / "mask.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        viz.draw(p, out, seq=args.draw_seq, title=args.title or f"spanattn show {args.preset or ''}".strip())
        print(f"\nwrote {out}")
    return 0


def cmd_demo(args) -> int:
    import torch

    from . import demo

    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"spanattn demo: error: --device {args.device}, but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else None
    names = args.backends.split(",") if args.backends else None
    try:
        return demo.run(args.device, dtype, args.out_dir, names, args.head_dim, args.seed, args.reps)
    except ValueError as e:  # bad --backends / --head-dim; a backend's own failure is a table row
        print(f"spanattn demo: error: {e}", file=sys.stderr)
        return 2


def cmd_bench(argv: list[str]) -> int:
    # imported only when chosen: the benchmark may pull in triton and the scenarios' sizes
    try:
        bench = importlib.import_module("spanattn.bench")
    except Exception as e:
        print(
            f"spanattn bench: error: cannot import spanattn.bench ({type(e).__name__}: {e})", file=sys.stderr
        )
        return 2
    about = (bench.__doc__ or "Benchmark the standard scenarios.").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="spanattn bench", description=about)
    bench.add_arguments(parser)
    rc = bench.main(parser.parse_args(argv))
    return rc if isinstance(rc, int) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spanattn", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{show,demo,bench}")
    show = sub.add_parser(
        "show",
        help="describe a step, print its mask as text, draw it as a PNG",
        epilog="presets:\n" + "\n".join(f"  {k:<15} {v}" for k, v in _presets().items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("--preset", choices=sorted(_presets()), help="a named step (see below)")
    show.add_argument(
        "--seq",
        action="append",
        type=_seq_arg,
        metavar="q=N,kv=M,spans=S-E,causal=1",
        help="one sequence; repeat for a batch (several spans: spans=1-5,9-12)",
    )
    show.add_argument("--q-len", type=int, help="queries of a single sequence")
    show.add_argument("--kv-len", type=int, help="keys of that sequence (default: --q-len)")
    show.add_argument("--prompt-len", type=int, help="whole prompt, when spans reach past this chunk")
    show.add_argument("--spans", type=_spans_arg, default=(), help="inclusive absolute spans: 40-79,90-99")
    show.add_argument("--non-causal", action="store_true", help="bidirectional rows (diffusion canvas)")
    show.add_argument("--window", type=_window_arg, default="keep", help="sliding window, or 'none'")
    show.add_argument("--mode", choices=SPAN_MODES, help="span mode of the layer (default: on)")
    show.add_argument("--noncausal-window", choices=("exclusive", "inclusive"))
    show.add_argument("--allow-split-spans", action="store_true", help="allow a chunk end inside a span")
    show.add_argument("--draw-seq", type=int, help="only this sequence")
    show.add_argument("--out", help="PNG path (default: OUT_DIR/mask.png)")
    show.add_argument("--out-dir", default="spanattn-out", help="directory for pictures")
    show.add_argument("--title", help="title of the picture")
    show.add_argument("--no-png", action="store_true", help="print only")
    show.set_defaults(run=cmd_show)

    demo = sub.add_parser("demo", help="a Gemma-4-like step on every backend vs the fp64 reference")
    demo.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    demo.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    demo.add_argument("--backends", help="comma-separated subset (default: every registered backend)")
    demo.add_argument("--head-dim", type=int, default=128)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--reps", type=int, help="timed calls per backend (default: 10 on CUDA, 2 on CPU)")
    demo.add_argument("--out-dir", default="spanattn-out", help="directory for pictures")
    demo.set_defaults(run=cmd_demo)

    # bench's own options live in spanattn.bench and are parsed there (see cmd_bench)
    sub.add_parser("bench", help="benchmark the standard scenarios (spanattn bench --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(argv[argv.index("bench") + 1 :])
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
