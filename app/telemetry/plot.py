"""Small line charts of the telemetry history, drawn server-side as SVG path data (the console ships no chart
library): the newest sample at the right edge, a gap wherever there was no reading."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

WIDTH = 320
HEIGHT = 96


@dataclass(frozen=True)
class Chart:
    title: str
    line: str
    area: str
    top_label: str
    latest_label: str
    span_label: str
    empty: bool
    width: int = WIDTH
    height: int = HEIGHT


def _segments(values: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    segments: list[list[tuple[int, float]]] = []
    current: list[tuple[int, float]] = []
    for i, value in enumerate(values):
        if value is None:
            if current:
                segments.append(current)
            current = []
        else:
            current.append((i, value))
    if current:
        segments.append(current)
    return segments


def line_chart(
    title: str,
    values: Sequence[float | None],
    *,
    slots: int,
    interval_s: float,
    fmt: Callable[[float], str],
    top: float | None = None,
) -> Chart:
    """`values` oldest first; the chart spans `slots` samples. `top` fixes the y axis (a capacity), else it follows
    the largest value."""
    values = list(values)[-slots:]
    offset = slots - len(values)
    present = [v for v in values if v is not None]
    y_top = top if top else max(present, default=0) * 1.15 or 1.0

    def point(i: int, v: float) -> str:
        x = (offset + i) / max(slots - 1, 1) * WIDTH
        y = HEIGHT - min(v / y_top, 1.0) * (HEIGHT - 2)
        return f"{x:.1f},{y:.1f}"

    line, area = [], []
    for segment in _segments(values):
        points = [point(i, v) for i, v in segment]
        line.append("M" + " L".join(points))
        first, last = point(segment[0][0], 0), point(segment[-1][0], 0)
        area.append(f"M{first} L" + " L".join(points) + f" L{last} Z")
    minutes = slots * interval_s / 60
    return Chart(
        title=title,
        line=" ".join(line),
        area=" ".join(area),
        top_label=fmt(y_top),
        latest_label=fmt(values[-1]) if values and values[-1] is not None else "n/a",
        span_label=f"last {minutes:.0f} min" if minutes >= 1 else f"last {slots * interval_s:.0f} s",
        empty=not present,
    )
