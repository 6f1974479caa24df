"""Each backend's efficiency against FA4's built-in causal/window kernel, per scenario, drawn from
committed JSONs (no GPU needed): the built-in's time over the backend's time on the same step,
from one ``spanattn bench`` run. The built-in ignores spans and per-sequence causal flags, so it
computes a simpler mask at the speed of light; 1.0 means as fast as it. The fa4 backend's medians
of alternating rounds (``gpu_fa4.py --parts alternate``; several files are pooled) are drawn as
markers, since single timings of one step move a few percent between runs.

    python benchmarks/plot_efficiency.py results/2026-11-29-bench-h200-s7.json \\
        --alternating results/2026-11-29-fa4-h200-u32-mask.json --out results/

Writes ``<bench JSON's name>-efficiency.png`` into ``--out`` and prints the numbers it drew.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BACKENDS = ("fa4", "triton", "flex", "flex+create_block_mask")
COLOURS = ("tab:green", "tab:orange", "tab:blue", "tab:red")


def ratios(bench: dict) -> dict[tuple[str, int], dict[str, float]]:
    """(scenario, head_dim) -> backend -> built-in ms / backend ms, where both ran."""
    ms = {(r["scenario"], r["d"], r["backend"]): r["ms"] for r in bench["rows"] if r.get("status") == "ok"}
    out = {}
    for (sid, d, name), t in ms.items():
        light = ms.get((sid, d, "fa4-builtin"))
        if light is not None and name in BACKENDS:
            out.setdefault((sid, d), {})[name] = light / t
    return out


def pooled(files: list[dict]) -> dict[tuple[str, int], tuple[float, int]]:
    """(scenario, head_dim) -> (median of every alternating round in ``files``, rounds)."""
    rounds = {}
    for f in files:
        for r in f.get("alternate", []):
            rounds.setdefault((r["scenario"], r["d"]), []).extend(r["ratios"])
    return {k: (statistics.median(v), len(v)) for k, v in rounds.items()}


def draw(path: Path, title: str, eff: dict, alt: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted(eff)
    width = 0.8 / len(BACKENDS)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for i, (name, colour) in enumerate(zip(BACKENDS, COLOURS)):
        xs = [c + (i - (len(BACKENDS) - 1) / 2) * width for c in range(len(cases))]
        ys = [eff[case].get(name, 0.0) for case in cases]
        ax.bar(xs, ys, width, label=f"{name} (one run)", color=colour)
        for x, y in zip(xs, ys):
            if y:  # inside the bar's top, so that the alternating markers above it stay readable
                ax.text(x, y - 0.015, f"{y:.2f}", ha="center", va="top", fontsize=7, color="white")
    if alt:
        x0 = -(len(BACKENDS) - 1) / 2 * width
        pts = [(c + x0, alt[case][0]) for c, case in enumerate(cases) if case in alt]
        label = "fa4, median of alternating rounds"
        ax.scatter(*zip(*pts), marker="_", s=300, linewidths=2.5, color="black", zorder=3, label=label)
        for x, y in pts:
            ax.text(x, y + 0.02, f"{y:.3f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(cases)), [f"{sid} d{d}" for sid, d in cases])
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("FA4 built-in time / backend time")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="a spanattn bench JSON with fa4-builtin rows")
    ap.add_argument("--alternating", nargs="*", default=[], help="gpu_fa4.py JSONs with an 'alternate' part")
    ap.add_argument("--out", required=True, help="folder for the PNG")
    a = ap.parse_args(argv)
    bench = json.loads(Path(a.bench).read_text())
    eff = ratios(bench)
    alt = pooled([json.loads(Path(f).read_text()) for f in a.alternating])
    alt = {k: v for k, v in alt.items() if k in eff}
    for case in sorted(eff):
        cells = "  ".join(f"{n} {eff[case][n]:.3f}" for n in BACKENDS if n in eff[case])
        more = f"  | fa4 alternating {alt[case][0]:.3f} ({alt[case][1]} rounds)" if case in alt else ""
        print(f"{case[0]} d{case[1]}: {cells}{more}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{Path(a.bench).stem}-efficiency.png"
    title = (
        "FA4's built-in causal/window kernel (no spans: a simpler mask) against each backend on the "
        f"same step\n{bench.get('gpu')}, torch {bench.get('torch')}, triton {bench.get('triton')}, "
        f"bf16, Hq 16 / Hkv 8, {bench.get('date', '')[:10]}"
    )
    draw(path, title, eff, alt)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
