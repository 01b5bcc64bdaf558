"""The plots of a report, drawn from rows and figures only (matplotlib, Agg: no screen needed).

Each function takes plain data, writes one figure and returns its path; nothing here reads
the run's files or computes a statistic the report does not also show (the bars' intervals
come from experiments.analysis.intervals). Latencies are scenario ms. Every figure is written in
each format of `formats(...)` (default PNG at 200 dpi and SVG, for a paper): the path given names
the PNG, its SVG twin sits beside it; the path returned is the first format written. SVGs
carry no date and a fixed id salt, so a redrawn report gives the same files, and keep their
text as text (the viewer's font), so a paper can edit a label.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np

from router.records import MIX_KEYS

from ..analysis.metrics import LatencyHist, PolicyStats
from ..run.rows import TokenRow

__all__ = ["FORMATS", "bars", "formats", "latency_cdf", "latency_over_time", "load_curves",
           "mix_bars", "paired_change", "sweep_plot"]

FORMATS = ("png", "svg")
DPI = 200
plt.rcParams["svg.hashsalt"] = "moemesh"  # repeatable element ids in the SVGs
plt.rcParams["svg.fonttype"] = "none"  # text stays text: editable and searchable in a paper
_formats: ContextVar[tuple[str, ...]] = ContextVar("plot_formats", default=FORMATS)
# Line styles and markers that tell the policies apart in grey print too.
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")

MIX_COLOURS = {"local_exact": "#2b8a3e", "remote_exact": "#1971c2", "cpu_loaded": "#f08c00",
               "substitute": "#9c36b5", "fallback": "#c92a2a"}
_GRID = np.concatenate([np.linspace(0, 90, 91), np.linspace(90.1, 99, 90),
                        np.linspace(99.05, 99.99, 20)])


@contextmanager
def formats(*names: str) -> Iterator[None]:
    """Figures drawn inside are written in these formats (each of FORMATS)."""
    bad = [n for n in names if n not in FORMATS]
    if bad or not names:
        raise ValueError(f"figure formats must be among {', '.join(FORMATS)}, got "
                         f"{', '.join(map(repr, names)) or 'none'}")
    token = _formats.set(tuple(names))
    try:
        yield
    finally:
        _formats.reset(token)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    written = []
    for fmt in _formats.get():
        out = path.with_suffix(f".{fmt}")
        fig.savefig(out, dpi=DPI, metadata={"Date": None} if fmt == "svg" else None)
        written.append(out)
    plt.close(fig)
    return written[0]


def _style(i: int) -> dict[str, Any]:
    """The i-th series' colour, line style and marker."""
    return {"color": f"C{i % 10}", "ls": _STYLES[i % len(_STYLES)],
            "marker": _MARKERS[i % len(_MARKERS)]}


def latency_cdf(tokens_by_policy: Mapping[str, Sequence[TokenRow]], path: Path) -> Path:
    """Token latency CDF per policy (measured tokens, warm-up left out), from HDR percentiles:
    the whole curve on a log axis, and the body (p5-p95) on a linear one beside it, where
    policies a few percent apart lie on top of each other otherwise. Each policy has its own
    colour, line style and markers (every 10th percentile, staggered per policy)."""
    fig, (whole, body) = plt.subplots(1, 2, figsize=(11, 4.2))
    lows, highs = [], []
    for i, (name, rows) in enumerate(tokens_by_policy.items()):
        h = LatencyHist.of(t.latency_ms for t in rows if t.ok and not t.warmup)
        if not h.count:
            continue
        xs = [h.pct(p) for p in _GRID]
        # markers every 10th percentile, staggered by 2 per policy so that none hides another
        marks = [j for j, p in enumerate(_GRID) if p <= 90 and (p - 2 * i) % 10 == 0]
        for ax in (whole, body):
            ax.plot(xs, _GRID / 100.0, label=name, lw=1.5, ms=4, markevery=marks,
                    **_style(i))
        lows.append(h.pct(5.0))
        highs.append(h.pct(95.0))
    whole.set_xscale("log")
    whole.set_xlabel("token latency (ms, scenario time, log scale)")
    whole.set_title("Token latency CDF per policy", fontsize=10)
    if lows:
        span = max(highs) - min(lows)
        body.set_xlim(min(lows) - 0.05 * span, max(highs) + 0.05 * span)
    body.set_ylim(0.05, 0.95)
    body.set_xlabel("token latency (ms, scenario time)")
    body.set_title("The body: 5th to 95th percentile", fontsize=10)
    for ax in (whole, body):
        ax.set_ylabel("share of tokens ≤ x")
        ax.grid(True, which="both", alpha=0.3)
    whole.set_ylim(0, 1.0)
    whole.legend(fontsize=8)
    return _save(fig, path)


def bars(stats: Sequence[PolicyStats], path: Path,
         intervals: Mapping[str, Mapping[str, tuple[float, float]]] | None = None) -> Path:
    """Four panels: mean and p99 token latency, traffic per 1,000 tokens, throughput; with
    `intervals` (experiments.analysis.intervals: policy → figure → 95% interval), error bars."""
    names = [s.name for s in stats]
    panels = [
        ("mean token latency (ms)", "mean", [s.latency["mean"] for s in stats]),
        ("p99 token latency (ms)", "p99", [s.latency["p99"] for s in stats]),
        ("traffic per 1,000 tokens (MB)", "traffic_per_1k",
         [s.traffic_per_1k / 1e6 for s in stats]),
        ("throughput (tokens/s)", None, [s.throughput_tok_s for s in stats]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    x = np.arange(len(names))
    for ax, (title, key, values) in zip(axes.flat, panels, strict=True):
        vals = [0.0 if v is None or not math.isfinite(v) else v for v in values]
        cis = [(intervals or {}).get(n, {}).get(key or "", (math.nan, math.nan))
               for n in names]
        err = [[max(0.0, v - lo) if math.isfinite(lo) else 0.0 for v, (lo, _) in
                zip(vals, cis, strict=True)],
               [max(0.0, hi - v) if math.isfinite(hi) else 0.0 for v, (_, hi) in
                zip(vals, cis, strict=True)]]
        ax.bar(x, vals, color="#1971c2", yerr=err if key and intervals else None, capsize=4,
               error_kw={"lw": 1, "ecolor": "#212529"})
        ax.set_title(title + (" ± 95% CI" if key and intervals else ""), fontsize=10)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        for xi, v in zip(x, vals, strict=True):
            ax.annotate(f"{v:.3g}", (xi, v), ha="center", va="bottom", fontsize=7,
                        xytext=(8, 0), textcoords="offset points")
    return _save(fig, path)


def _change_bars(cells: Sequence[tuple[float, float, float]]
                 ) -> tuple[list[float], list[list[float]]]:
    """(change, CI low, CI high) cells → the changes and matplotlib's asymmetric error bars
    (none where a cell has no interval)."""
    mid = [c[0] for c in cells]
    low = [c[0] - c[1] if math.isfinite(c[1]) else 0.0 for c in cells]
    high = [c[2] - c[0] if math.isfinite(c[2]) else 0.0 for c in cells]
    return mid, [low, high]


def paired_change(by_metric: Mapping[str, Mapping[str, tuple[float, float, float]]],
                  against: str, path: Path, *, title: str = "") -> Path:
    """The headline figure of a run: one panel per metric, each policy's paired change
    against `against` (%) as a point with its 95% CI (experiments.analysis.paired), zero marked;
    an interval clear of zero is drawn solid, one across it hollow."""
    fig, axes = plt.subplots(1, len(by_metric), squeeze=False,
                             figsize=(4.2 * len(by_metric), 0.5 * max(
                                 (len(v) for v in by_metric.values()), default=1) + 1.6))
    for ax, (metric, cells) in zip(axes[0], by_metric.items(), strict=True):
        names = list(cells)
        mid, err = _change_bars([cells[n] for n in names])
        ys = np.arange(len(names))[::-1]
        for j, (name, y) in enumerate(zip(names, ys, strict=True)):
            _, lo, hi = cells[name]
            clear = math.isfinite(lo) and (lo > 0 or hi < 0)
            ax.errorbar([mid[j]], [y], xerr=[[err[0][j]], [err[1][j]]], fmt="o", capsize=4,
                        color=f"C{(j + 1) % 10}", mfc=f"C{(j + 1) % 10}" if clear else "white")
        ax.axvline(0.0, color="0.4", lw=1)
        ax.set_yticks(ys, names, fontsize=8)
        ax.set_ylim(-0.7, len(names) - 0.3)
        ax.set_xlabel(f"{metric.replace('_', ' ')} vs {against} (%)", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title or f"Paired change against {against}, 95% CI (hollow: CI spans 0)",
                 fontsize=10)
    return _save(fig, path)


def mix_bars(stats: Sequence[PolicyStats], path: Path) -> Path:
    """Execution mix: share of expert executions per kind, stacked per policy."""
    names = [s.name for s in stats]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    bottom = np.zeros(len(names))
    x = np.arange(len(names))
    for key in MIX_KEYS:
        vals = np.array([100.0 * s.mix[key] for s in stats])
        ax.bar(x, vals, bottom=bottom, label=key.replace("_", " "), color=MIX_COLOURS[key])
        bottom += vals
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of expert executions")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("Execution mix per policy")
    return _save(fig, path)


def _spans(faults: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, float | None]]:
    """(description, start, end) of each fault: a down and its matching up form one span."""
    open_: dict[tuple[str, tuple[str, ...]], tuple[str, float]] = {}
    out: list[tuple[str, float, float | None]] = []
    undo = {"link-up": "link-down", "node-up": "node-down"}
    for f in faults:
        if f.get("applied") is False:  # the workload ended before it was due
            continue
        key_target = tuple(f.get("target", ()))
        action = f.get("action", "")
        t = float(f.get("done_s", f.get("at_s", 0.0)))
        if action in ("link-down", "node-down", "link-degrade", "node-slow"):
            open_[(action, key_target)] = (f.get("description", action), t)
        elif action in undo and (undo[action], key_target) in open_:
            desc, start = open_.pop((undo[action], key_target))
            out.append((desc, start, t))
        elif action == "link-up" and ("link-degrade", key_target) in open_:
            desc, start = open_.pop(("link-degrade", key_target))
            out.append((desc, start, t))
        else:
            out.append((f.get("description", action), t, None))
    out += [(desc, start, None) for desc, start in open_.values()]
    return out


def lag_spans(per_node: Mapping[str, Mapping[str, Any]] | None) -> list[tuple[float, float]]:
    """The merged spans (scenario seconds) in which any node's event loop was more than 5 ms
    late, from one arm's `run.json` `loop_lag` entry (experiments.run.looplag)."""
    spans = sorted((float(a), float(b)) for entry in (per_node or {}).values()
                   for a, b, *_ in entry.get("intervals", ()))
    out: list[tuple[float, float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def latency_over_time(tokens_by_policy: Mapping[str, Sequence[TokenRow]],
                      faults_by_policy: Mapping[str, Sequence[Mapping[str, Any]]],
                      path: Path, *, warmup_s: float = 0.0, bin_s: float | None = None,
                      lag_by_policy: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """Mean token latency per time bin, one panel per policy, faults shaded and marked,
    failed tokens as red ticks at the bottom; with `lag_by_policy` (run.json's `loop_lag`),
    the spans where any node's event loop was more than 5 ms late in purple (widened to be
    seen, and ticked at the top)."""
    names = list(tokens_by_policy)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.9 * len(names) + 0.6),
                             sharex=True, squeeze=False)
    end = max((t.done_s for rows in tokens_by_policy.values() for t in rows
               if math.isfinite(t.done_s)), default=1.0)
    width = bin_s or max(end / 60.0, 0.25)
    for ax, name in zip(axes[:, 0], names, strict=True):
        rows = tokens_by_policy[name]
        bins: dict[int, list[float]] = defaultdict(list)
        for t in rows:
            if t.ok and math.isfinite(t.done_s):
                bins[int(t.done_s // width)].append(t.latency_ms)
        if bins:
            ks = sorted(bins)
            ax.plot([(k + 0.5) * width for k in ks], [float(np.mean(bins[k])) for k in ks],
                    lw=1.0, marker=".", ms=4, color="#1971c2", label="mean token latency")
        fails = [t.sent_s if not math.isfinite(t.done_s) else t.done_s
                 for t in rows if not t.ok]
        if fails:
            ax.plot(fails, [0] * len(fails), "|", color="#c92a2a", ms=8, label="failed token")
        if warmup_s > 0:
            ax.axvspan(0, warmup_s, color="#adb5bd", alpha=0.25, lw=0)
        lags = lag_spans((lag_by_policy or {}).get(name))
        seen = end / 300.0  # a 10 ms stall on a 40 s axis is a hairline: widen it
        for j, (a, b) in enumerate(lags):
            ax.axvspan(a, max(b, a + seen), color="#9c36b5", alpha=0.35, lw=0,
                       label="loop lag > 5 ms" if j == 0 else None)
        if lags:
            ax.plot([a for a, _ in lags], [1.0] * len(lags), "v", color="#9c36b5", ms=4,
                    transform=ax.get_xaxis_transform(), clip_on=False)
        for i, (desc, start, stop) in enumerate(_spans(faults_by_policy.get(name, ()))):
            if stop is None:
                ax.axvline(start, color="#e8590c", ls="--", lw=1)
            else:
                ax.axvspan(start, stop, color="#e8590c", alpha=0.15, lw=0)
            ax.annotate(desc.replace(" (both ways)", ""), (start, 0.97 - 0.12 * (i % 4)),
                        xycoords=("data", "axes fraction"), fontsize=6, va="top",
                        color="#d9480f")
        ax.set_ylabel("ms", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
    label = "time since the workload's start (s, scenario time); grey: warm-up"
    if lag_by_policy:
        label += "; purple: a node's event loop > 5 ms late"
    axes[-1, 0].set_xlabel(label)
    return _save(fig, path)


def sweep_plot(param: str, points: Sequence[float], series: Mapping[str, Sequence[float]],
               ylabel: str, path: Path, *, title: str = "") -> Path:
    """One line per policy over a swept parameter."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, ys in series.items():
        vals = [math.nan if y is None else y for y in ys]
        ax.plot(points, vals, marker="o", label=name)
    ax.set_xlabel(param)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"{ylabel} vs {param}")
    return _save(fig, path)


def paired_plot(param: str, points: Sequence[float],
                by_metric: Mapping[str, Mapping[str, Sequence[tuple[float, float, float]]]],
                against: str, path: Path, *, title: str = "") -> Path:
    """One panel per metric: each policy's paired change against `against` (%) over a swept
    parameter, with its 95% CI as error bars (nan where the point has none)."""
    fig, axes = plt.subplots(1, len(by_metric), figsize=(6.5 * len(by_metric), 4),
                             squeeze=False)
    for ax, (metric, series) in zip(axes[0], by_metric.items(), strict=True):
        for i, (name, cells) in enumerate(series.items()):
            mid, err = _change_bars(cells)
            ax.errorbar(points, mid, yerr=err, marker="o", capsize=3,
                        color=f"C{(i + 1) % 10}", label=name)
        ax.axhline(0.0, color="0.4", lw=1)
        ax.set_xlabel(param)
        ax.set_ylabel(f"{metric.replace('_', ' ')} vs {against} (%, paired 95% CI)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"Paired change against {against} vs {param}", fontsize=10)
    return _save(fig, path)


def load_curves(xlabel: str, by_policy: Mapping[str, Sequence[Any]], target: float,
                slo_ms: float, path: Path, *, title: str = "") -> Path:
    """SLO attainment, mean and p99 token latency against the offered load, one line per
    policy. Each point has `load`, `slo_share`, `mean_ms`, `p99_ms` and `faithful`; a point the
    host distorted is drawn hollow (its figures describe the host as much as the mesh)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("slo_share", 100.0, f"requests within {slo_ms:g} ms (%)"),
              ("mean_ms", 1.0, "mean token latency (ms)"),
              ("p99_ms", 1.0, "p99 token latency (ms)"))
    for i, (name, points) in enumerate(by_policy.items()):
        pts = sorted(points, key=lambda p: p.load)
        colour = f"C{i % 10}"
        xs = [p.load for p in pts]
        for ax, (key, scale, _) in zip(axes, panels, strict=True):
            ys = [scale * getattr(p, key) for p in pts]
            ax.plot(xs, ys, color=colour, lw=1.4, label=name)
            ax.scatter(xs, ys, color=colour, s=22, zorder=3,
                       facecolors=[colour if p.faithful else "none" for p in pts])
    axes[0].axhline(100.0 * target, color="0.4", ls="--", lw=1, label=f"target {target:.0%}")
    axes[0].set_ylim(0, 102)
    for ax, (_, _, ylabel) in zip(axes, panels, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle((title or "SLO attainment and latency vs offered load")
                 + " (hollow: host-distorted point)", fontsize=10)
    return _save(fig, path)
