"""Charts of a benchmark run: time per configuration per backend against speed-of-light.

One panel per KV format; in a panel, one group of bars per configuration (one bar per backend,
log-scaled microseconds, lower is better) and a black tick at the format's speed-of-light time.

``write_svg`` needs nothing beyond the standard library, so every run leaves a picture (GitHub
renders SVG in a README).  ``write_png`` draws the same chart with matplotlib when it is installed.
"""
from __future__ import annotations

import math
from html import escape
from typing import Dict, List, Optional, Sequence

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def _plot_rows(results: Sequence[dict]) -> List[dict]:
    return [r for r in results if r.get("status") in ("ok", "mismatch") and r.get("kind") in ("decode", "prefill")
            and r.get("time_us")]


def _layout(rows: List[dict]):
    formats = list(dict.fromkeys(r["format"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    return formats, configs, backends


def write_svg(results: Sequence[dict], path: str, title: str = "") -> Optional[str]:
    """Write the chart as SVG; returns the path, or None when there is nothing to plot."""
    rows = _plot_rows(results)
    if not rows:
        return None
    formats, configs, backends = _layout(rows)
    color = {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(backends)}
    vals = [r["time_us"] for r in rows] + [r["sol_us"] for r in rows if r.get("sol_us")]
    lo = 10 ** math.floor(math.log10(max(min(vals), 1e-3)))
    hi = 10 ** math.ceil(math.log10(max(vals) * 1.01))
    bar_w, gap = 10, 14
    group_w = bar_w * len(backends) + gap
    left, right, top, panel_h, label_h = 70, 20, 60, 170, 70
    width = left + right + group_w * len(configs)
    height = top + len(formats) * (panel_h + label_h)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="14">{escape(title or "time per call (us, log scale; lower is better)")}</text>']
    # Legend.
    x = left
    for b in backends:
        out.append(f'<rect x="{x}" y="30" width="10" height="10" fill="{color[b]}"/>'
                   f'<text x="{x + 14}" y="39">{escape(b)}</text>')
        x += 24 + 7 * len(b)
    out.append(f'<line x1="{x}" y1="35" x2="{x + 16}" y2="35" stroke="black" stroke-width="2"/>'
               f'<text x="{x + 20}" y="39">speed-of-light</text>')

    def ypos(v, y0):
        f = (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        return y0 + panel_h * (1 - f)

    by_key: Dict[tuple, dict] = {(r["format"], r["config"], r["backend"]): r for r in rows}
    for fi, fmt in enumerate(formats):
        y0 = top + fi * (panel_h + label_h)
        out.append(f'<text x="{left}" y="{y0 - 4}" font-weight="bold">{escape(fmt)}</text>')
        dec = lo
        while dec <= hi * 1.0001:
            y = ypos(dec, y0)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#ddd"/>'
                       f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{dec:g}</text>')
            dec *= 10
        out.append(f'<line x1="{left}" y1="{y0}" x2="{left}" y2="{y0 + panel_h}" stroke="black"/>')
        for ci, cfg in enumerate(configs):
            gx = left + ci * group_w + gap / 2
            sol = None
            for bi, b in enumerate(backends):
                r = by_key.get((fmt, cfg, b))
                if r is None:
                    continue
                y = ypos(r["time_us"], y0)
                out.append(f'<rect x="{gx + bi * bar_w:.1f}" y="{y:.1f}" width="{bar_w - 1}" '
                           f'height="{y0 + panel_h - y:.1f}" fill="{color[b]}">'
                           f'<title>{escape(cfg)} {escape(fmt)} {escape(b)}: {r["time_us"]:.1f} us</title></rect>')
                sol = r.get("sol_us") or sol
            if sol:
                y = ypos(sol, y0)
                out.append(f'<line x1="{gx - 2:.1f}" y1="{y:.1f}" x2="{gx + bar_w * len(backends) + 1:.1f}" '
                           f'y2="{y:.1f}" stroke="black" stroke-width="2"/>')
            lx, ly = gx + bar_w * len(backends) / 2, y0 + panel_h + 10
            out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="end" '
                       f'transform="rotate(-35 {lx:.1f} {ly:.1f})">{escape(cfg)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path


def write_png(results: Sequence[dict], path: str, title: str = "") -> Optional[str]:
    """The same chart with matplotlib; returns None when matplotlib is missing or nothing to plot."""
    rows = _plot_rows(results)
    if not rows:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    formats, configs, backends = _layout(rows)
    by_key = {(r["format"], r["config"], r["backend"]): r for r in rows}
    fig, axes = plt.subplots(len(formats), 1, figsize=(max(8, 0.6 * len(configs) * max(1, len(backends)) / 2),
                                                        3.2 * len(formats)), squeeze=False)
    width = 0.8 / len(backends)
    for ax, fmt in zip(axes[:, 0], formats):
        for bi, b in enumerate(backends):
            xs, ys = [], []
            for ci, cfg in enumerate(configs):
                r = by_key.get((fmt, cfg, b))
                if r is not None:
                    xs.append(ci - 0.4 + width * (bi + 0.5))
                    ys.append(r["time_us"])
            if xs:
                ax.bar(xs, ys, width=width, label=b, color=PALETTE[bi % len(PALETTE)])
        for ci, cfg in enumerate(configs):
            sols = [by_key[(fmt, cfg, b)]["sol_us"] for b in backends if (fmt, cfg, b) in by_key]
            if sols and sols[0]:
                ax.hlines(sols[0], ci - 0.45, ci + 0.45, colors="black", linewidth=2,
                          label="speed-of-light" if ci == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel("us per call")
        ax.set_title(fmt, loc="left", fontsize=10)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, rotation=35, ha="right", fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=min(4, len(backends) + 1))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["write_svg", "write_png"]
