"""The performance plot of a run's report, drawn server-side as SVG geometry (the console ships no chart library):
per metric a bar for this run's p50 with a tick at its p95, and, on the same shape, a bar for production's p50."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WIDTH = 640
LABEL_W = 150
VALUE_W = 120
ROW_H = 40
BAR_H = 12
PLOT_W = WIDTH - LABEL_W - VALUE_W


@dataclass(frozen=True)
class Bar:
    series: str
    x: float
    y: float
    width: float
    height: float
    text: str
    # The p95 tick's x (this run only).
    p95_x: float | None

    @property
    def text_x(self) -> float:
        """The value's label starts past the bar and its p95 tick."""
        return max(self.x + self.width, self.p95_x or 0.0) + 6


@dataclass(frozen=True)
class Row:
    label: str
    y: float
    bars: list[Bar]


@dataclass(frozen=True)
class BarChart:
    title: str
    unit: str
    note: str
    rows: list[Row]
    width: int
    height: int
    plot_x: int
    plot_w: int
    empty: bool


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.2f} {unit}" if unit == "s" else f"{value:,.0f} {unit}"


def bar_chart(
    title: str,
    unit: str,
    metrics: list[tuple[str, str]],
    mine: dict[str, Any] | None,
    theirs: dict[str, Any] | None,
    against: str | None,
    note: str,
) -> BarChart:
    """`metrics` as (measurement, label); `mine` and `theirs` are performance measurements ({"p50", "p95"})."""
    values = []
    for key, _ in metrics:
        for source, quantile in ((mine, "p50"), (mine, "p95"), (theirs, "p50")):
            value = ((source or {}).get(quantile) or {}).get(key)
            if value is not None:
                values.append(value)
    top = max(values, default=0) * 1.08 or 1.0
    rows = []
    for i, (key, label) in enumerate(metrics):
        y = 8 + i * ROW_H
        bars = []
        p50 = ((mine or {}).get("p50") or {}).get(key)
        p95 = ((mine or {}).get("p95") or {}).get(key)
        if p50 is not None:
            bars.append(
                Bar(
                    "this run",
                    LABEL_W,
                    y,
                    max(p50 / top * PLOT_W, 1),
                    BAR_H,
                    f"{_fmt(p50, unit)}" + (f" (p95 {_fmt(p95, unit)})" if p95 is not None else ""),
                    LABEL_W + p95 / top * PLOT_W if p95 is not None else None,
                )
            )
        theirs_p50 = ((theirs or {}).get("p50") or {}).get(key)
        if theirs_p50 is not None:
            bars.append(
                Bar(
                    against or "production",
                    LABEL_W,
                    y + BAR_H + 4,
                    max(theirs_p50 / top * PLOT_W, 1),
                    BAR_H,
                    _fmt(theirs_p50, unit),
                    None,
                )
            )
        rows.append(Row(label, y, bars))
    return BarChart(
        title=title,
        unit=unit,
        note=note,
        rows=rows,
        width=WIDTH,
        height=16 + len(metrics) * ROW_H,
        plot_x=LABEL_W,
        plot_w=PLOT_W,
        empty=not values,
    )


def performance_charts(
    mine: dict[str, Any] | None, theirs: dict[str, Any] | None, against: str | None
) -> list[BarChart]:
    note = (
        f"p50 bars with a p95 tick; {against}'s p50 on the same shape below" if theirs else "p50 bars with a p95 tick"
    )
    return [
        bar_chart(
            "Latency",
            "s",
            [("ttfo_s", "TTFO"), ("ttft_s", "TTFT"), ("e2e_s", "E2E")],
            mine,
            theirs,
            against,
            note,
        ),
        bar_chart(
            "Throughput",
            "tok/s",
            [("prefill_tok_s", "Prefill (incl. queueing)"), ("decode_tok_s", "Decode")],
            mine,
            theirs,
            against,
            note,
        ),
    ]
