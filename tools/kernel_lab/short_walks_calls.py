"""Several calls of ``short_walks.py`` side by side: every step's per-pair efficiency in each call,
the best contender's, and which of the short-walk targets each call meets. A ratio moves 1-3%
from one call to the next on unchanged kernels (the GPU's clock and the pairing of blocks), so a
target near 1.0 is read over calls, not from one. No GPU needed: it reads committed JSONs.

    python tools/kernel_lab/short_walks_calls.py results/A.json results/B.json results/C.json --out results/

Prints a line per step and the targets' verdict per call; writes ``<first JSON's stem>-calls.png``
(efficiency per step, a marker per call and contender; S5 in TFLOP/s beside it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spanattn.bench.report import pyplot

CONTENDERS = ("triton", "triton, one program per item", "fa4")
COLOURS = {"triton": "tab:orange", "triton, one program per item": "tab:olive", "fa4": "tab:green"}
# The targets short_walks.py records in its JSON ("targets"), and d512's rate (TFLOP/s), checked
# on the steps whose efficiency FA4's built-in kernel defines (S0-S4) and on S5.
D512_TFLOPS = 450.0
FLOOR = 0.9  # the efficiency axis's floor


def step(row: dict) -> str:
    return f"{row['scenario']} d{row['d']}"


def by_step(call: dict) -> dict[str, dict]:
    """step -> the call's row for it."""
    return {step(r): r for r in call["rows"]}


def efficiencies(row: dict) -> dict[str, float]:
    """contender -> its per-pair efficiency on the row's step, for those that have one."""
    return {n: c["efficiency"] for n, c in row["contenders"].items() if "efficiency" in c}


def best(row: dict) -> tuple[str, float] | None:
    """The contender with the highest efficiency on the row's step (any backend or launch the
    library offers: triton either way, fa4), or None where none has one."""
    effs = efficiencies(row)
    return max(effs.items(), key=lambda kv: kv[1]) if effs else None


def verdict(call: dict) -> dict[str, list[str]]:
    """target -> the steps of one call that miss it (empty: met). Steps without FA4's built-in
    (no efficiency) count as misses of the efficiency targets: nothing shows them met."""
    targets = call["targets"]
    misses = {f"triton >= {targets['triton']}": [], f"best >= {targets['best']}": [],
              f"d512 >= {D512_TFLOPS:g} TFLOP/s": []}  # fmt: skip
    t_key, b_key, d_key = misses
    for row in call["rows"]:
        if row["d"] == 512:
            tflops = row["contenders"].get("triton", {}).get("tflops", 0.0)
            if tflops < D512_TFLOPS:
                misses[d_key].append(f"{step(row)} {tflops:.1f}")
            continue
        effs, top = efficiencies(row), best(row)
        if effs.get("triton", 0.0) < targets["triton"]:
            misses[t_key].append(f"{step(row)} {effs.get('triton', 0.0):.3f}")
        if top is None or top[1] < targets["best"]:
            misses[b_key].append(f"{step(row)} {top[1] if top else 0.0:.3f}")
    return misses


def lines(calls: list[dict]) -> list[str]:
    """A line per step (each call's triton and best efficiency), then each call's verdict."""
    indexed = [by_step(c) for c in calls]
    out = []
    for first in calls[0]["rows"]:
        s = step(first)
        rows = [b.get(s) for b in indexed]
        if first["d"] == 512:
            rates = [f"{r['contenders']['triton']['tflops']:.0f}" if r else "-" for r in rows]
            out.append(f"{s}: triton {' / '.join(rates)} TFLOP/s")
            continue
        tri = [f"{efficiencies(r).get('triton', 0.0):.3f}" if r else "-" for r in rows]
        tops = [f"{b[1]:.3f} ({b[0]})" if r and (b := best(r)) else "-" for r in rows]
        out.append(f"{s}: triton {' / '.join(tri)} | best {' / '.join(tops)}")
    for i, c in enumerate(calls):
        parts = [f"{t}: " + ("met" if not m else "missed on " + ", ".join(m)) for t, m in verdict(c).items()]
        out.append(f"call {i + 1} ({c['gpu']}, {c['date']}): " + "; ".join(parts))
    return out


def draw(path: Path, calls: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    steps = [step(r) for r in calls[0]["rows"] if r["d"] != 512]
    d512 = [step(r) for r in calls[0]["rows"] if r["d"] == 512]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), width_ratios=[len(steps), max(len(d512), 1) + 1])
    ax, ax5 = axes
    indexed = [by_step(c) for c in calls]
    spread = 0.6 / max(len(CONTENDERS) * len(calls) - 1, 1)

    def at(x, ci, k):  # contender ci's marker of call k beside step x
        return x - 0.3 + (ci * len(calls) + k) * spread

    for ci, name in enumerate(CONTENDERS):
        low = {}  # step -> this contender's efficiencies below FLOOR, over the calls
        for k, rows in enumerate(indexed):
            effs = [(x, efficiencies(rows[s]).get(name)) for x, s in enumerate(steps) if s in rows]
            pts = [(at(x, ci, k), y, x) for x, y in effs if y is not None]
            for _, y, i in pts:
                if y < FLOOR:
                    low.setdefault(i, []).append(y)
            # Below FLOOR (fa4 where it copies K/V: S3) a marker sits on the floor, its range
            # written once above it, so that the axis keeps the 1% steps near the targets readable.
            ax.scatter([x for x, _, _ in pts], [max(y, FLOOR) for _, y, _ in pts], s=18,
                       color=COLOURS[name], label=name if k == 0 else None)  # fmt: skip
        for i, ys in low.items():
            x = at(i, ci, (len(calls) - 1) / 2)
            ax.annotate(f"{min(ys):.2f}-{max(ys):.2f}", (x, FLOOR), xytext=(0, 6), textcoords="offset points",
                        fontsize=7, ha="center", color=COLOURS[name])  # fmt: skip
    ax.set_ylim(FLOOR - 0.01, None)
    targets = calls[0]["targets"]
    for level in sorted({targets["triton"], targets["best"]}):
        ax.axhline(level, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(steps)), steps)
    ax.set_ylabel("per-pair rate / FA4 built-in's")
    ax.set_title(f"Efficiency per useful pair, {len(calls)} calls (a marker per call)")
    ax.legend(fontsize=8)
    for k, rows in enumerate(indexed):
        ys = [rows[s]["contenders"]["triton"]["tflops"] if s in rows else None for s in d512]
        ax5.scatter([x - 0.2 + 0.4 * k / max(len(calls) - 1, 1) for x in range(len(d512))], ys, s=18,
                    color=COLOURS["triton"])  # fmt: skip
    ax5.axhline(D512_TFLOPS, color="grey", lw=0.8, ls="--")
    ax5.set_xticks(range(len(d512)), d512)
    ax5.set_xlim(-1, len(d512))
    ax5.set_ylim(D512_TFLOPS - 15, D512_TFLOPS + 15)
    ax5.set_ylabel("TFLOP/s")
    ax5.set_title("d512, triton")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calls", nargs="+", type=Path, help="short_walks.py JSONs, one per call")
    ap.add_argument("--out", required=True, type=Path, help="folder for the PNG")
    args = ap.parse_args(argv)
    calls = [json.loads(p.read_text()) for p in args.calls]
    if any("targets" not in c or "rows" not in c for c in calls):
        ap.error("calls: every JSON must be short_walks.py's (with 'targets' and 'rows')")
    print("\n".join(lines(calls)))
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.calls[0].stem}-calls.png"
    draw(png, calls)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
