"""The report's first lines: one sentence per policy against the reference, and why.

A reader should not have to find the comparison table to learn what a run showed. Each
sentence says who won the mean token latency (paired by request, `experiments.analysis.paired`), by
how much, with its paired 95% CI, and where the difference lies in the latency split
(docs/measurement.md: network, queue, load, compute, dense, host overhead; means per
completed measured token). A change whose CI holds 0 is "no significant difference", with
its CI, and no winner is named. Traffic per token follows in the same sentence, as HetRoute's
second claim is about it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..analysis.metrics import Comparison, PolicyStats

__all__ = ["PARTS", "headline_lines", "why"]

# split column → what a reader calls it (the split of docs/measurement.md)
PARTS = {"link_ms": "network", "queue_ms": "queue", "load_ms": "load",
         "compute_ms": "compute", "dense_ms": "dense", "overhead_ms": "host overhead"}


def _ci(c: Comparison) -> str:
    return f"paired 95% CI {c.ci_low_pct:+.1f}% to {c.ci_high_pct:+.1f}%"


def why(ref: PolicyStats, other: PolicyStats) -> str:
    """Where `other`'s mean token latency differs from `ref`'s, by split part: the parts that
    moved, largest first, as signed differences in ms per completed measured token; "mostly"
    names the largest when it moved the same way as the total and is at least half of it."""
    diffs = {name: other.split.get(k, math.nan) - ref.split.get(k, math.nan)
             for k, name in PARTS.items()}
    diffs = {k: v for k, v in diffs.items() if math.isfinite(v)}
    if not diffs:
        return "the token rows carry no latency split, so where it differs is not known"
    order = sorted(diffs, key=lambda k: -abs(diffs[k]))
    shown = [k for k in order if abs(diffs[k]) >= 0.05] or order[:1]
    parts = ", ".join(f"{k} {diffs[k]:+.1f}" for k in shown)
    total, top = sum(diffs.values()), diffs[order[0]]
    if top * total > 0 and abs(top) >= abs(total) / 2:
        return f"mostly in the {order[0]} ({parts} ms per token)"
    return f"spread over the split ({parts} ms per token)"


def _sentence(ref: PolicyStats, other: PolicyStats, lat: Comparison,
              traffic: Comparison | None) -> str:
    a, b = f"`{lat.a}`", f"`{lat.b}`"
    if not math.isfinite(lat.change_pct) or not math.isfinite(lat.ci_low_pct):
        text = (f"{b} against {a}: too few paired requests for a comparison of mean token "
                f"latency ({lat.n_a})")
    elif not lat.significant:
        text = (f"{b} against {a}: no significant difference in mean token latency "
                f"({lat.value_b:.1f} against {lat.value_a:.1f} ms, {lat.change_pct:+.1f}%, "
                f"{_ci(lat)}, {lat.n_a} requests)")
    else:
        way = "lower" if lat.change_pct < 0 else "higher"
        text = (f"{b} had a {abs(lat.change_pct):.1f}% {way} mean token latency than {a} "
                f"({lat.value_b:.1f} against {lat.value_a:.1f} ms, {_ci(lat)}, "
                f"{lat.n_a} requests), {why(ref, other)}")
    if traffic is not None and math.isfinite(traffic.ci_low_pct):
        text += (f"; traffic per token {traffic.change_pct:+.1f}% ({_ci(traffic)})"
                 if traffic.significant else
                 f"; no significant difference in traffic per token "
                 f"({traffic.change_pct:+.1f}%, {_ci(traffic)})")
    return text + "."


def headline_lines(stats: Sequence[PolicyStats], comps: Sequence[Comparison],
                   faithful: bool = True) -> list[str]:
    """The opening sentences (module docstring): one per policy after the first, or nothing
    with fewer than two policies; a caution line when the run is not faithful."""
    if len(stats) < 2 or not comps:
        return []
    by_name: Mapping[str, PolicyStats] = {s.name: s for s in stats}
    ref = stats[0]
    by_pair = {(c.b, c.metric): c for c in comps}
    lines = [f"Each policy against `{ref.name}` (the first listed), paired by request; "
             f"'Comparisons' below has every metric, 'Latency split' the parts:", ""]
    for s in stats[1:]:
        lat = by_pair.get((s.name, "mean_latency"))
        if lat is None:
            continue
        lines.append(f"- {_sentence(ref, by_name[s.name], lat, by_pair.get((s.name, 'traffic')))}")
    if not faithful:
        lines += ["", "These come from a run that is not faithful: read them with the reasons "
                      "above."]
    return [*lines, ""]
