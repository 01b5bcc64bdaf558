"""The figures of a report, for a paper: SVG beside PNG, the paired headline with its CIs,
error bars on the bars, CDFs that can be told apart, and `moemesh report --format`."""

from __future__ import annotations

import argparse
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from experiments.analysis.intervals import policy_intervals
from experiments.commands import register
from experiments.report import plots
from experiments.report.report import build_report
from tests.experiments.conftest import arm, make_rows, write_run

PNG = b"\x89PNG\r\n\x1a\n"
SVG = "{http://www.w3.org/2000/svg}"


def _run(tmp_path: Path) -> Path:
    gr_t, gr_r = make_rows("greedy", 30.0, seed=2, nbytes=1500)
    hr_t, hr_r = make_rows("hetroute", 20.0, seed=3, nbytes=1000)
    return write_run(tmp_path / "run", [arm("greedy"), arm("hetroute")], gr_t + hr_t,
                     gr_r + hr_r, [])


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *argv])
    return args.handler(args)


def test_the_headline_figure_is_the_paired_change_with_its_ci(tmp_path: Path) -> None:
    folder = _run(tmp_path)
    summary = build_report(folder)
    text = (folder / "report.md").read_text()
    assert text.index("![paired change against greedy with its 95% CI](paired.png)") < \
        text.index("](latency_cdf.png)")  # first among the plots
    svg = ET.parse(folder / "paired.svg").getroot()
    labels = "".join(svg.itertext())
    assert "Paired change against greedy" in labels
    # hetroute is 20 ms against greedy's 30: about -33%, clear of zero
    (mean,) = [c for c in summary["comparisons"] if c["metric"] == "mean_latency"]
    assert mean["change_pct"] < -25
    assert (folder / "paired.png").read_bytes()[:8] == PNG


def test_a_redrawn_svg_is_the_same_file(tmp_path: Path) -> None:
    folder = _run(tmp_path)
    build_report(folder)
    first = {p.name: p.read_bytes() for p in folder.glob("*.svg")}
    build_report(folder)
    assert len(first) == 5
    assert {p.name: p.read_bytes() for p in folder.glob("*.svg")} == first


def test_bars_carry_each_policys_interval_by_request(tmp_path: Path) -> None:
    gr_t, _ = make_rows("greedy", 30.0, seed=2, nbytes=1500)
    ci = policy_intervals({"greedy": gr_t}, seed=7)["greedy"]
    assert ci == policy_intervals({"greedy": gr_t}, seed=7)["greedy"]  # seeded: repeatable
    done = [t.latency_ms for t in gr_t if t.ok and not t.warmup]
    mean = sum(done) / len(done)
    lo, hi = ci["mean"]
    assert lo < mean < hi and hi - lo < mean  # around the mean, and not everything
    assert ci["p99"][0] <= ci["p99"][1]
    assert all(math.isfinite(v) for v in ci["traffic_per_1k"])


def test_each_cdf_has_its_own_line_style(tmp_path: Path) -> None:
    rows = {name: make_rows(name, ms, seed=i)[0]
            for i, (name, ms) in enumerate([("a", 10.0), ("b", 10.5), ("c", 11.0)])}
    with plots.formats("svg"):
        path = plots.latency_cdf(rows, tmp_path / "cdf.png")
    assert path == tmp_path / "cdf.svg" and not (tmp_path / "cdf.png").exists()
    styles = {e.get("style", "") for e in ET.parse(path).getroot().iter(f"{SVG}path")
              if "stroke-dasharray" in e.get("style", "")}
    assert len(styles) >= 2  # dashed and dash-dotted beside the solid line


def test_report_format_picks_the_files(tmp_path: Path) -> None:
    folder = _run(tmp_path)
    assert _report([str(folder), "--format", "svg"]) == 0
    assert (folder / "bars.svg").is_file() and not (folder / "bars.png").exists()
    assert "](bars.svg)" in (folder / "report.md").read_text()
    assert _report([str(folder), "--format", "png"]) == 0
    assert (folder / "bars.png").read_bytes()[:8] == PNG
    assert "](bars.png)" in (folder / "report.md").read_text()
    with pytest.raises(SystemExit):
        _report([str(folder), "--format", "pdf"])
    with (pytest.raises(ValueError, match="figure formats must be among png, svg, got 'pdf'"),
          plots.formats("pdf")):
        pass
