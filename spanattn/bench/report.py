"""The benchmark's outputs: a table on stdout, a JSON file of every row, a PNG bar chart."""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import torch

FLOPS_NOTE = "TFLOP/s = 4 * D * Hq * allowed_pairs / time (allowed pairs only, the FA3/FA4 convention)"


def add_ratios(rows: list[dict]) -> None:
    """``vs_best_peer`` = fastest exact peer's kernel time / this row's (above 1: faster than it);
    ``vs_speed_of_light`` = the same against peers that compute a simpler mask (FA4's built-in
    causal/window on a layer with spans): how close the exact mask gets to not having spans."""
    for key in {(r["scenario"], r["d"]) for r in rows}:
        case = [r for r in rows if (r["scenario"], r["d"]) == key and r.get("ms")]
        peers = [r["ms"] for r in case if r["kind"] == "peer" and r.get("exact_mask", True)]
        light = [r["ms"] for r in case if r["kind"] == "peer" and not r.get("exact_mask", True)]
        for r in case:
            r["vs_best_peer"] = round(min(peers) / r["ms"], 3) if peers else None
            r["vs_speed_of_light"] = round(min(light) / r["ms"], 3) if light else None


def _fmt(x, spec):
    return format(x, spec) if x is not None else format("-", ">" + spec.split(".")[0])


def _ratio(x, width: int) -> str:
    return f"{x:{width - 1}.2f}x" if x else f"{'-':>{width - 1}} "


def table(rows: list[dict]) -> str:
    head = f"{'scenario':9} {'d':>4} {'backend':24} {'ms':>9} {'TFLOP/s':>8} {'plan ms':>8} {'vs peer':>8}"
    head += f" {'vs SoL':>7}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        if r["status"] == "ok" and r.get("note"):
            status += f" ({r['note']})"
        lines.append(
            f"{r['scenario']:9} {r['d']:>4} {r['backend']:24} {_fmt(r.get('ms'), '9.3f')} "
            f"{_fmt(r.get('tflops'), '8.2f')} {_fmt(r.get('plan_ms'), '8.3f')} "
            f"{_ratio(r.get('vs_best_peer'), 8)} {_ratio(r.get('vs_speed_of_light'), 7)}  {status}"
        )
    return "\n".join(lines)


def environment(device) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def result_path(folder, topic: str, env: dict) -> Path:
    """Where a benchmark script writes its JSON: ``folder/<date>-<topic>-<gpu>.json``, the folder
    made if missing, ``env`` as ``environment`` returns it.

    >>> import tempfile
    >>> result_path(tempfile.mkdtemp(), "decode", {"date": "2026-11-29T09:32", "gpu": "NVIDIA H200"}).name
    '2026-11-29-decode-h200.json'
    """
    gpu = re.sub(r"[^a-z0-9]+", "-", (env.get("gpu") or "cpu").lower().replace("nvidia", "")).strip("-")
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{env['date'][:10]}-{topic}-{gpu}.json"


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({**meta, "flops": FLOPS_NOTE, "rows": rows}, indent=1) + "\n")


def pyplot():
    """matplotlib's pyplot drawing to files (the Agg backend), or None where matplotlib is
    missing: the pictures are optional, the JSON is the result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def labelled_bars(ax, rows: list[dict], names: list[str], key: str, fmt: str, fontsize: int = 7) -> None:
    """One group of bars per row (a benchmark's ``{"scenario", "d", "contenders": {name:
    {key: value}}}``), one bar per contender in ``names`` (0 where it has no ``key``), each
    labelled with its value in ``fmt``; the groups' ticks name the scenario and head_dim."""
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(rows))]
        ys = [r["contenders"].get(n, {}).get(key, 0.0) for r in rows]
        ax.bar(xs, ys, width, label=n)
        for x, y in zip(xs, ys):
            if y:
                ax.text(x, y, format(y, fmt), ha="center", va="bottom", fontsize=fontsize)
    ax.set_xticks(range(len(rows)), [f"{r['scenario']} d{r['d']}" for r in rows])


def write_png(path: Path, meta: dict, rows: list[dict]) -> bool:
    """Grouped bars of TFLOP/s per (scenario, d), one colour per backend. False if no matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if r.get("tflops")]
    cases = list(dict.fromkeys(f"{r['scenario']} d{r['d']}" for r in ok))
    names = list(dict.fromkeys(r["backend"] for r in ok))
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cases) + 2), 4.5))
    for j, name in enumerate(names):
        mine = [r for r in ok if r["backend"] == name]
        got = {f"{r['scenario']} d{r['d']}": r["tflops"] for r in mine}
        xs = [i + (j - (len(names) - 1) / 2) * width for i, c in enumerate(cases) if c in got]
        exact = all(r.get("exact_mask", True) for r in mine)
        # a peer computing a simpler mask is a speed of light, not a competitor: hatched
        label = name if exact else f"{name} (no spans: a simpler mask)"
        ax.bar(xs, [got[c] for c in cases if c in got], width, label=label, hatch=None if exact else "//")
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("TFLOP/s (allowed pairs only)")
    where = meta.get("gpu") or f"CPU ({meta.get('cpu')}), small sizes"
    ax.set_title(f"spanattn bench: {where}, torch {meta.get('torch')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
