"""bench/plots.py draws the recorded results as SVG: the command line on copies of bench/results' JSON, the bars
against the numbers, and the charts in bench/results drawn from the JSON beside them (none stale)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

from bench.plots import CHARTS
from tests.support import ROOT

RESULTS = ROOT / "bench" / "results"
SVG = "{http://www.w3.org/2000/svg}"


def _bars(svg_text: str) -> dict[str, float]:
    """Bar width by its tooltip's '<group>, <series>' (the background rect has no tooltip)."""
    root = ET.fromstring(svg_text)
    return {rect.find(f"{SVG}title").text.rsplit(":", 1)[0]: float(rect.get("width"))
            for rect in root.iter(f"{SVG}rect") if rect.find(f"{SVG}title") is not None}  # fmt: skip


def test_the_command_draws_each_recorded_result(tmp_path):
    for name in ("serve.json", "kernels.json"):
        shutil.copy(RESULTS / name, tmp_path / name)
    done = subprocess.run([sys.executable, "bench/plots.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "serve.svg"), str(tmp_path / "kernels.svg")]

    serve = json.loads((tmp_path / "serve.json").read_text())
    bars = _bars((tmp_path / "serve.svg").read_text())
    assert len(bars) == len(serve["decode_tok_s"]) == 6
    rates = {f"{c} concurrent request{'s' * (c > 1)}, {p}": serve["decode_tok_s"][f"{p}_c{c}"]
             for c in (1, 16, 64) for p in ("8K", "1M")}  # fmt: skip
    top = max(rates.values())
    for bar, rate in rates.items():  # linear: each bar is its rate's share of the longest
        assert abs(bars[bar] / bars[max(rates, key=rates.get)] - rate / top) < 1e-3, bar

    kernels = json.loads((tmp_path / "kernels.json").read_text())
    bars = _bars((tmp_path / "kernels.svg").read_text())
    assert set(bars) == {"fallback, 8K configured", "fallback, 128K configured", "fallback, 1M configured",
                         "ours, 1M configured"}  # fmt: skip
    # log scale: the 1M fallback is the longest, ours the shortest, and a decade is the same length everywhere
    assert max(bars, key=bars.get) == "fallback, 1M configured" and min(bars, key=bars.get) == "ours, 1M configured"
    fallback = kernels["fallback_index_topk_us"]
    decade = (bars["fallback, 1M configured"] - bars["fallback, 8K configured"]) / math.log10(
        fallback["1048576"] / fallback["8192"]
    )
    ours = bars["fallback, 8K configured"] - decade * math.log10(fallback["8192"] / kernels["index_topk_1m_graph_us"])
    assert abs(bars["ours, 1M configured"] - ours) < 0.2


def test_the_recorded_charts_are_drawn_from_the_recorded_numbers():
    # The demo model's chart comes with its first recorded run (issue 31); the first wave's are recorded.
    recorded = [source for source in CHARTS if (RESULTS / source).exists()]
    assert {"serve.json", "kernels.json"} <= set(recorded)
    for source in recorded:
        target, chart = CHARTS[source]
        assert (RESULTS / target).read_text() == chart(json.loads((RESULTS / source).read_text())), target
        report = (RESULTS / source).with_suffix(".md").read_text()
        assert f"]({target})" in report, f"{source[:-5]}.md does not show {target}"
