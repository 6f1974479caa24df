"""Pictures of a Plan's mask: a PNG (``draw``) and a text drawing for small steps (``ascii``).

Both read only the intervals ``lo/hi`` (and span groups' ids), never a dense ``[q_len, kv_len]``
mask, so a 32k-token step is drawn as cheaply as a toy one: each pixel's colour is the exact
fraction of its (query, key) pairs that are allowed, computed from the intervals.
"""

from __future__ import annotations

import dataclasses

import torch

from .plan import plan as make_plan

MAX_PIXELS = 900  # image cells per axis; beyond this pixels cover several rows/keys exactly
ASCII_MAX_KEYS, ASCII_MAX_ROWS = 120, 160
MAX_DRAWN_SEQS = 8

CAUSAL, NONCAUSAL, SPAN = (0.18, 0.36, 0.68), (0.15, 0.58, 0.35), (0.93, 0.51, 0.10)


def _rows(plan, i: int, layer=None):
    """``lo, hi`` (int64, CPU) of sequence ``i`` and its span groups (rows and keys counted in
    the sequence, CPU; None without groups); with ``layer`` recomputed under that policy."""
    p = plan if layer is None else make_plan(plan.batch, layer, "cpu")
    r = p.seq_slice(i)
    groups = None
    if p.groups is not None:
        k0 = sum(s.kv_len for s in p.batch.seqs[:i])
        cpu = dataclasses.replace(
            p.groups, **{f: getattr(p.groups, f).cpu() for f in ("q_group", "k_group", "spans")}
        )
        groups = cpu.sequence(r, slice(k0, k0 + p.batch.seqs[i].kv_len))
    return p.lo[r].cpu().long(), p.hi[r].cpu().long(), groups


def coverage(lo, hi, kv_len: int, rows_per_px: int, keys_per_px: int, groups=None) -> torch.Tensor:
    """Fraction of allowed pairs in each ``rows_per_px x keys_per_px`` cell, from intervals only
    (plus, for rows of a span group, the group's keys outside the interval: ``groups``).

    O(rows + cells): a row's interval fills the key cells strictly between its end cells
    completely (added as a difference along each cell row, then a cumsum) and its two end cells
    partly (added directly); a group's row counts its keys per cell by binary search, O(cells).
    No ``[q_len, kv_len]`` array is ever built.
    """
    r, c = rows_per_px, keys_per_px
    n, n_cols = lo.numel(), -(-kv_len // c)
    n_rows = -(-n // r)
    row = (torch.arange(n) // r) * (n_cols + 1)  # flat offset of each query's cell row
    jl, jh = lo // c, hi // c
    same = jl == jh
    full = torch.zeros(n_rows * (n_cols + 1), dtype=torch.int64)
    full.index_add_(0, row + jl + 1, torch.where(same, 0, c))
    full.index_add_(0, row + jh, torch.where(same, 0, -c))
    ends = torch.zeros_like(full)
    ends.index_add_(0, row + jl, torch.where(same, hi - lo + 1, (jl + 1) * c - lo))
    ends.index_add_(0, row + jh, torch.where(same, 0, hi - jh * c + 1))
    cnt = (full.view(n_rows, -1).cumsum(1) + ends.view(n_rows, -1))[:, :n_cols]
    if groups is not None:
        first = torch.arange(n_cols) * c
        last = (first + c - 1).clamp_max(kv_len - 1)
        for rows in (groups.q_group >= 0).nonzero().flatten().split(4096):  # bounded memory
            shape = (len(rows), n_cols)
            g, a, b = (
                groups.q_group[rows].long()[:, None].expand(shape),
                first.expand(shape),
                last.expand(shape),
            )
            extra = groups.outside(g, lo[rows][:, None].expand(shape), hi[rows][:, None].expand(shape), a, b)
            cnt.index_add_(0, rows // r, extra)
    rows_in = torch.full((n_rows,), r)
    rows_in[-1] = n - r * (n_rows - 1)
    keys_in = torch.full((n_cols,), c)
    keys_in[-1] = kv_len - c * (n_cols - 1)
    return cnt.double() / (rows_in[:, None] * keys_in[None]).double()


def _image(plan, i: int, max_pixels: int):
    """RGBA image of sequence ``i`` plus the number of rows and keys per pixel.

    Opacity is the allowed fraction, so span bands drawn underneath tint only masked pixels.
    """
    seq = plan.batch.seqs[i]
    r = -(-seq.q_len // max_pixels)
    c = -(-seq.kv_len // max_pixels)
    lo, hi, groups = _rows(plan, i)
    total = coverage(lo, hi, seq.kv_len, r, c, groups)
    base_layer = dataclasses.replace(plan.layer, spans="off")
    base = coverage(*_rows(plan, i, base_layer)[:2], seq.kv_len, r, c)
    base_rgb = torch.tensor(CAUSAL if seq.causal else NONCAUSAL, dtype=torch.float64)
    span_rgb = torch.tensor(SPAN, dtype=torch.float64)
    # colour by what allowed the pairs: the window/causal rule or only the span
    share = (base / total.clamp_min(1e-9))[..., None]
    rgb = share * base_rgb + (1 - share) * span_rgb
    return torch.cat([rgb, total[..., None]], dim=-1).clamp(0, 1).numpy(), r, c


def _seq_title(plan, i: int, r: int, c: int, label: str | None) -> str:
    seq = plan.batch.seqs[i]
    role = (
        "canvas" if not seq.causal else "decode row" if seq.q_len == 1 else "chunk" if seq.ctx else "prefill"
    )
    lo, hi, groups = _rows(plan, i)
    pairs = int((hi - lo + 1).sum()) + (0 if groups is None else groups.extra_pairs(lo, hi))
    head = (
        f"{label} (window={plan.layer.window}, spans={plan.layer.spans!r}): seq {i}" if label else f"seq {i}"
    )
    text = (
        f"{head} ({role}): q_len {seq.q_len} of kv_len {seq.kv_len}, ctx {seq.ctx}, "
        f"{'causal' if seq.causal else 'NON-CAUSAL'}, {pairs:,} allowed pairs"
    )
    return text + ("" if r == c == 1 else f"   [1 px = {r}x{c} pairs, opacity = allowed fraction]")


def _edge(ax, ctx: int, kv: int, offset: float) -> None:
    """The window boundary ``k = q + offset`` (in cell edges): a staircase along the rows while
    rows are wide enough to see, a straight line beyond that."""
    if kv - ctx <= 2000:
        ys = [y for q in range(ctx, kv) for y in (q - 0.5, q + 0.5)]
        xs = [q + offset for q in range(ctx, kv) for _ in (0, 1)]
    else:
        ys, xs = [ctx - 0.5, kv - 0.5], [ctx + offset, kv + offset]
    ax.plot(xs, ys, color="crimson", ls=":", lw=1.5, zorder=3)


def _draw_spans(ax, seq) -> None:
    """Spans shaded on both axes (under the mask, so only masked pairs are tinted), labelled,
    and the block of each span that holds this step's queries outlined."""
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import blended_transform_factory as blend

    ctx, kv = seq.ctx, seq.kv_len
    style = dict(fontsize=8, color="saddlebrown", textcoords="offset points")
    bar = dict(color=SPAN, lw=5, solid_capstyle="butt", clip_on=False, zorder=5)
    for n, (s, e) in enumerate(sp for sp in seq.spans if sp[0] < kv):
        e_in = min(e, kv - 1)
        long = (e_in - s + 1) / kv > 0.012 * (len(str(s)) + len(str(e)) + 10)  # crowded: index only
        ax.axvspan(s - 0.5, e_in + 0.5, color=SPAN, alpha=0.15, lw=0, zorder=1)
        # a bar on the top spine marks the span's keys even where every pair is allowed
        ax.plot([s - 0.5, e_in + 0.5], [1, 1], transform=blend(ax.transData, ax.transAxes), **bar)
        label = f"image {n} [{s},{e}]" if long else str(n)
        ax.annotate(label, ((s + e_in) / 2, 1), xycoords=blend(ax.transData, ax.transAxes), xytext=(0, 4),
                    ha="center", va="bottom", **style)  # fmt: skip
        if e_in < ctx:
            continue
        y0 = max(s, ctx)
        ax.axhspan(y0 - 0.5, e_in + 0.5, color=SPAN, alpha=0.15, lw=0, zorder=1)
        ax.plot([1, 1], [y0 - 0.5, e_in + 0.5], transform=blend(ax.transAxes, ax.transData), **bar)
        box = Rectangle((s - 0.5, y0 - 0.5), e_in - s + 1, e_in - y0 + 1, fill=False, ls="--", lw=1.2)
        ax.add_patch(box).set(ec="saddlebrown", zorder=3)
        tall = (e_in - y0 + 1) / (kv - ctx) > 0.15
        side = blend(ax.transAxes, ax.transData)
        ax.annotate(f"image {n}" if tall else str(n), (1, (y0 + e_in) / 2), xycoords=side, xytext=(5, 0),
                    va="center", rotation=90 if tall else 0, **style)  # fmt: skip


def _draw_seq(ax, plan, i: int, max_pixels: int, label: str | None = None) -> None:
    from matplotlib.transforms import blended_transform_factory as blend

    seq, w = plan.batch.seqs[i], plan.layer.window
    ctx, kv = seq.ctx, seq.kv_len
    img, r, c = _image(plan, i, max_pixels)
    extent = (-0.5, img.shape[1] * c - 0.5, ctx + img.shape[0] * r - 0.5, ctx - 0.5)
    ax.imshow(img, extent=extent, aspect="auto", interpolation="nearest", zorder=2)
    ax.set(xlim=(-0.5, kv - 0.5), ylim=(kv - 0.5, ctx - 0.5))
    _draw_spans(ax, seq)
    if w is not None:  # window edges: past side always, future side for non-causal rows
        wide = not seq.causal and plan.layer.noncausal_window == "inclusive"
        _edge(ax, ctx, kv, -w + 0.5 - wide)
        ax.text(ctx - w + 0.5, ctx - 0.5, f"W={w} ", color="crimson", fontsize=8, ha="right", va="top",
                zorder=3, clip_on=True)  # fmt: skip
        if not seq.causal:
            _edge(ax, ctx, kv, w - 0.5 + wide)
    if kv <= 48 and seq.q_len <= 48:  # big cells: outline each one so pairs can be counted
        ax.set_xticks(range(kv))
        ax.set_yticks(range(ctx, kv))
        ax.set_xticks([k - 0.5 for k in range(kv + 1)], minor=True)
        ax.set_yticks([q - 0.5 for q in range(ctx, kv + 1)], minor=True)
        ax.set_axisbelow(False)  # cell grid over the image
        ax.grid(which="minor", color="white", lw=0.6)
        ax.tick_params(which="minor", length=0)
    if ctx > 0:  # chunk boundary: keys left of it are in the cache, queries start there
        ax.axvline(ctx - 0.5, color="black", lw=1.4, zorder=3)
        left = ctx > 0.75 * kv
        ax.text(ctx - 0.5, 0.03, f" cached keys < ctx={ctx} " if left else f" ctx={ctx}: chunk ",
                transform=blend(ax.transData, ax.transAxes), ha="right" if left else "left", va="bottom",
                fontsize=7, zorder=4, bbox=dict(fc="white", ec="black", lw=0.5, pad=1.5))  # fmt: skip
    if seq.q_len == 1:
        ax.set_yticks([ctx])
    ax.set_title(_seq_title(plan, i, r, c, label), fontsize=9, loc="left", pad=17 if seq.spans else 6)
    ax.set_ylabel("query (ctx + i)", fontsize=8)
    ax.tick_params(labelsize=8)


def _render(panels, path, head: str, max_pixels: int, dpi: int) -> str:
    """One axes per ``(plan, seq, label)`` panel, stacked, with a shared legend."""
    # Figure without pyplot: no global state, and its PNG goes through Agg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    # fixed layout in inches (tight_layout would render all text twice): title, then per panel
    # a header (title, span labels) and the axes, then the legend
    seqs = [p.batch.seqs[i] for p, i, _ in panels]
    heights = [min(6.0, max(0.45, 7.5 * s.q_len / s.kv_len)) for s in seqs]
    top, header, gap, bottom, width = 0.6, 0.55, 0.3, 0.85, 10.0
    fig_h = top + sum(heights) + header * len(panels) + gap * (len(panels) - 1) + bottom
    fig = Figure(figsize=(width, fig_h))
    y = fig_h - top
    for (p, i, label), h in zip(panels, heights):
        y -= header + h
        ax = fig.add_axes((0.8 / width, y / fig_h, 1 - 1.3 / width, h / fig_h))
        _draw_seq(ax, p, i, max_pixels, label)
        y -= gap
    ax.set_xlabel("key position", fontsize=9)
    fig.suptitle(head, fontsize=11, y=1 - 0.1 / fig_h, va="top")
    legend = [
        Patch(color=CAUSAL, label="allowed: causal (+window)"),
        Patch(color=NONCAUSAL, label="allowed: non-causal (+window)"),
        Patch(color=SPAN, label="allowed only via image span or span group"),
        Patch(fc="white", ec="gray", label="masked"),
        Line2D([], [], color="crimson", ls=":", label="window edge"),
        Line2D([], [], color="black", label="chunk boundary (ctx)"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=6, fontsize=7.5, frameon=False)
    fig.savefig(path, dpi=dpi)
    return str(path)


def _check_seq(plan, seq: int) -> None:
    if not 0 <= seq < plan.num_seqs:
        raise ValueError(f"seq must be in [0, {plan.num_seqs}), got {seq}")


def draw(plan, path, seq=None, title=None, max_pixels: int = MAX_PIXELS, dpi: int = 110) -> str:
    """Write a PNG of the allowed (query, key) pairs of every sequence (or only ``seq``).

    Rows are queries at absolute positions, columns keys. Blue/green: allowed by the causal or
    non-causal base rule (with the window); orange: allowed only through a span; white: masked.
    Dashed boxes outline spans, the dotted red line is the window edge, the black line is the
    chunk boundary ``ctx``. At most 8 sequences are drawn. Returns ``path``.
    """
    ids = list(range(plan.num_seqs)) if seq is None else [seq]
    for i in ids:
        _check_seq(plan, i)
    layer = plan.layer
    sub = f"window={layer.window}, spans={layer.spans!r}"
    if any(not plan.batch.seqs[i].causal for i in ids):
        sub += f", non-causal window {layer.noncausal_window}"
    if len(ids) > MAX_DRAWN_SEQS:
        sub += f"  (first {MAX_DRAWN_SEQS} of {plan.num_seqs} sequences)"
    panels = [(plan, i, None) for i in ids[:MAX_DRAWN_SEQS]]
    return _render(panels, path, f"{title or 'spanattn mask'}\nlayer: {sub}", max_pixels, dpi)


def compare(plans: dict, path, seq: int = 0, title=None, max_pixels: int = MAX_PIXELS, dpi: int = 110) -> str:
    """Write a PNG of sequence ``seq`` under several plans (e.g. one per span mode), one panel
    per ``{label: plan}`` entry, to see what each policy allows."""
    for p in plans.values():
        _check_seq(p, seq)
    panels = [(p, seq, label) for label, p in list(plans.items())[:MAX_DRAWN_SEQS]]
    return _render(panels, path, title or f"seq {seq} under {len(panels)} policies", max_pixels, dpi)


def ascii(plan, seq: int = 0, max_keys: int = ASCII_MAX_KEYS, max_rows: int = ASCII_MAX_ROWS) -> str:
    """Text drawing of sequence ``seq``: ``#`` allowed, ``.`` masked, one row per query.

    Header lines: key positions (mod 10), ``c`` under cached keys (before ``ctx``), and span
    letters ``a, b, ...`` under each span's keys; the same letter follows a query's position
    when it lies in that span.

    >>> import spanattn as sa
    >>> p = sa.plan(sa.Batch([sa.Seq(q_len=3, kv_len=5, spans=[(2, 3)])]), sa.LayerMask(window=2))
    >>> print(ascii(p))
    seq 0: q_len 3 of kv_len 5 (ctx 2), causal; layer window=2, spans='on'
     key 01234
     ctx cc
    span   aa
      2a .###.
      3a ..##.
      4  ...##
    """
    if not 0 <= seq < plan.num_seqs:
        raise ValueError(f"seq must be in [0, {plan.num_seqs}), got {seq}")
    s = plan.batch.seqs[seq]
    if s.kv_len > max_keys or s.q_len > max_rows:
        raise ValueError(
            f"ascii() draws at most {max_rows} queries x {max_keys} keys; seq {seq} has "
            f"q_len {s.q_len} x kv_len {s.kv_len}: use spanattn.viz.draw() for a PNG"
        )
    dense = plan.to_dense(seq).cpu()  # a small step: its dense mask (intervals and span groups)
    letters = [" "] * s.kv_len
    for n, (a, e) in enumerate(s.spans):
        for k in range(a, min(e, s.kv_len - 1) + 1):
            letters[k] = chr(ord("a") + n % 26)
    width = max(4, len(str(s.kv_len - 1)) + 1)
    lines = [
        f"seq {seq}: q_len {s.q_len} of kv_len {s.kv_len} (ctx {s.ctx}), "
        f"{'causal' if s.causal else 'non-causal'}; layer window={plan.layer.window}, "
        f"spans={plan.layer.spans!r}",
        "key".rjust(width) + " " + "".join(str(k % 10) for k in range(s.kv_len)),
        "ctx".rjust(width) + " " + "c" * s.ctx,
        "span".rjust(width) + " " + "".join(letters).rstrip(),
    ]
    for i in range(s.q_len):
        q = s.ctx + i
        row = "".join("#" if allowed else "." for allowed in dense[i].tolist())
        lines.append(f"{q:>{width - 1}}{letters[q]} {row}")
    return "\n".join(line.rstrip() for line in lines)
