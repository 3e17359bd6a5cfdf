"""Charts of the recorded bench results, for whoever would rather look than read: plain SVG files beside the JSON
they are drawn from (no plotting library). The benches draw them when they write their results; to draw them again
for results already recorded:

    python bench/plots.py bench/results

- `serve.svg` (from serve.json): decode tok/s of the 8K and 1M profiles at each concurrency: configured context
  must not cost throughput (field report (a): 532 vs 64 tok/s at 64 requests).
- `kernels.svg` (from kernels.json): one c4 layer's indexer + top-k per decode step, batch 64 at 512 actual tokens:
  the old fallback at each configured maximum against ours at 1M, on a log scale.
- `demo-model.svg` (from demo-model.json): the demo model's training losses over the tokens trained on, on a log
  scale.
"""

from __future__ import annotations

import argparse
import json
import math
from html import escape
from pathlib import Path

WIDTH, BAR, GAP, LABEL, VALUE = 760, 22, 6, 210, 110
COLORS = {"8K": "#7a8fa6", "1M": "#1f5fa8", "fallback": "#b5533c", "ours": "#1f5fa8"}


def bar_chart(title: str, subtitle: str, groups: list[tuple[str, list[tuple[str, float, str]]]], unit: str,
              log: bool = False) -> str:  # fmt: skip
    """Horizontal bars: groups of (label, [(series, value, value text)]), one row per bar, coloured by the series'
    name up to its first comma; lengths linear in the value, or in log10(value) from one decade below the smallest."""
    values = [v for _, bars in groups for _, v, _ in bars]
    if log:
        low = 10 ** (math.floor(math.log10(min(values))) - 1)
        span = math.log10(max(values) / low)

        def length(v: float) -> float:
            return math.log10(v / low) / span
    else:
        top = max(values)

        def length(v: float) -> float:
            return v / top

    plot = WIDTH - LABEL - VALUE
    rows, y = [], 58
    for group, bars in groups:
        if group:
            rows.append(f'<text x="0" y="{y + 14}" class="group">{escape(group)}</text>')
        for series, value, text in bars:
            w = max(1.0, plot * length(value))
            color = COLORS.get(series.split(",")[0], "#555")
            tooltip = f"{', '.join(filter(None, (group, series)))}: {text} {unit}"
            rows.append(f'<text x="{LABEL - 8}" y="{y + 15}" class="series">{escape(series)}</text>'
                        f'<rect x="{LABEL}" y="{y}" width="{w:.1f}" height="{BAR}" fill="{color}">'
                        f"<title>{escape(tooltip)}</title></rect>"
                        f'<text x="{LABEL + w + 6:.1f}" y="{y + 15}" class="value">{escape(text)}</text>')  # fmt: skip
            y += BAR + GAP
        y += 2 * GAP
    height = y + 24
    scale = "log scale" if log else "linear scale"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'role="img" aria-label="{escape(title)}">'
        "<style>text{font:13px sans-serif;fill:#222}.title{font-size:16px;font-weight:bold}.sub{fill:#555}"
        ".group{font-weight:bold}.series{text-anchor:end}.value{fill:#333}.axis{fill:#777;font-size:11px}</style>"
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>'
        f'<text x="0" y="20" class="title">{escape(title)}</text>'
        f'<text x="0" y="40" class="sub">{escape(subtitle)}</text>' + "".join(rows)
        + f'<text x="{LABEL}" y="{height - 8}" class="axis">{escape(unit)}, {scale}</text></svg>\n'
    )  # fmt: skip


def serve_chart(serve: dict) -> str:
    rates = serve["decode_tok_s"]
    concurrencies = sorted({int(key.split("_c")[1]) for key in rates})
    groups = [(f"{c} concurrent request{'s' * (c > 1)}",
               [(name, rates[f"{name}_c{c}"], f"{rates[f'{name}_c{c}']:,.0f}") for name in ("8K", "1M")])
              for c in concurrencies]  # fmt: skip
    subtitle = (
        f"profiles differing only in context_length, 512-token prompts; 1M/8K at 64: "
        f"{serve['context_length_ratio_c64']:.3f}; {serve['gpu']}, commit {serve['commit']}, {serve['date']}"
    )
    return bar_chart("Decode throughput: 8K vs 1M configured context", subtitle, groups, "decode tok/s")


def kernels_chart(kernels: dict) -> str:
    def context(tokens: int) -> str:
        return f"{tokens >> 20}M" if tokens >= 1 << 20 else f"{tokens >> 10}K"

    fallback = sorted((int(k), us) for k, us in kernels["fallback_index_topk_us"].items())
    ours = kernels["index_topk_1m_graph_us"]
    bars = [(f"fallback, {context(k)} configured", us, f"{us:,.1f} µs") for k, us in fallback]
    groups = [("", [*bars, ("ours, 1M configured", ours, f"{ours:,.1f} µs")])]
    subtitle = (f"one c4 layer, batch 64, 512 actual tokens; ×{kernels['speedup_vs_torch_fallback']:,.0f} at 1M; "
                f"{kernels['gpu']}, commit {kernels['commit']}, {kernels['date']}")  # fmt: skip
    return bar_chart("Indexer + top-k per decode step: work that follows the actual length", subtitle, groups,
                     "µs per layer and step", log=True)  # fmt: skip


def line_chart(title: str, subtitle: str, series: dict[str, list[tuple[float, float]]], x_unit: str,
               y_unit: str) -> str:  # fmt: skip
    """Lines of (x, y) points, one per series, x linear from zero, y on a log scale over the decades the values
    span; a legend of the series' names at the right."""
    height, left, top, plot_w, plot_h = 420, 60, 58, WIDTH - 60 - 150, 300
    points = [pt for pts in series.values() for pt in pts]
    x_max = max(x for x, _ in points)
    y_lo = 10 ** math.floor(math.log10(min(y for _, y in points)))
    y_hi = 10 ** math.ceil(math.log10(max(y for _, y in points)))

    def at(x: float, y: float) -> str:
        fy = math.log10(y / y_lo) / math.log10(y_hi / y_lo)
        return f"{left + plot_w * x / x_max:.1f},{top + plot_h * (1 - fy):.1f}"

    palette = ("#1f5fa8", "#b5533c", "#7a8fa6", "#4d8b31", "#8a4fa8")
    parts = [f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>']
    for k in range(round(math.log10(y_hi / y_lo)) + 1):
        y = top + plot_h * (1 - k / math.log10(y_hi / y_lo))
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" class="series">{y_lo * 10**k:g}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{top + plot_h + 16}" class="series">{x_max:,.0f}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = palette[i % len(palette)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" '
                     f'points="{" ".join(at(x, y) for x, y in pts)}"><title>{escape(name)}</title></polyline>'
                     f'<rect x="{left + plot_w + 16}" y="{top + 22 * i}" width="14" height="4" fill="{color}"/>'
                     f'<text x="{left + plot_w + 36}" y="{top + 22 * i + 6}">{escape(name)}</text>')  # fmt: skip
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'role="img" aria-label="{escape(title)}">'
        "<style>text{font:13px sans-serif;fill:#222}.title{font-size:16px;font-weight:bold}.sub{fill:#555}"
        ".series{text-anchor:end;font-size:11px;fill:#777}.axis{fill:#777;font-size:11px}</style>"
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>'
        f'<text x="0" y="20" class="title">{escape(title)}</text>'
        f'<text x="0" y="40" class="sub">{escape(subtitle)}</text>' + "".join(parts)
        + f'<text x="{left}" y="{height - 30}" class="axis">{escape(x_unit)}; {escape(y_unit)}, log scale</text>'
        + "</svg>\n"
    )  # fmt: skip


def demo_chart(demo: dict) -> str:
    curve = demo["curve"]
    series = {name: [(c["tokens"], c[name]) for c in curve] for name in ("lm", "prompt", "mtp", "indexer")}
    subtitle = (f"{curve[-1]['step'] + 1} steps, {curve[-1]['tokens'] / 1e6:.1f}M tokens, the last call at "
                f"{curve[-1]['tok_s']:,} tok/s; {demo['gpu']}, commit {demo['commit']}, {demo['date']}")  # fmt: skip
    return line_chart("Demo model: training losses", subtitle, series, "tokens trained on", "loss (nats per token)")


CHARTS = {
    "serve.json": ("serve.svg", serve_chart),
    "kernels.json": ("kernels.svg", kernels_chart),
    "demo-model.json": ("demo-model.svg", demo_chart),
}


def draw(results: Path, only: str | None = None) -> list[Path]:
    """Draw the chart of each result JSON in `results` (or of `only`, one of CHARTS' keys); returns the files
    written."""
    written = []
    for source, (target, chart) in CHARTS.items():
        if (only is None or only == source) and (results / source).exists():
            (results / target).write_text(chart(json.loads((results / source).read_text())))
            written.append(results / target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a folder of bench results (serve.json, kernels.json)")
    for path in draw(parser.parse_args().results):
        print(path)


if __name__ == "__main__":
    main()
