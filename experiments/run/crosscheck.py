"""Virtual against real time: do the two clocks tell the same story? (`moemesh run --clock both`)

The same scenario runs twice on the same seeded requests: in virtual time (netem.virtual) and
on the dilated wall clock. A request's tokens are the same tokens in both, so each policy's
mean and p99 token latency are compared paired by request (experiments.analysis.paired: the realtime
run against the virtual one, the change in percent with its 95% bootstrap CI). The clocks
agree on a policy when the mean is within `MEAN_TOL_PCT` and the p99 within `P99_TOL_PCT`
(what a faithful realtime run's own host share and run-to-run noise allow); a difference
beyond that is a bug in one of the two and the table says which policy shows it.

Files: `crosscheck.json` and `crosscheck.md` beside the two runs' folders (`virtual/`,
`realtime/`).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..analysis.paired import paired_compare
from ..report.report import load_run

__all__ = ["MEAN_TOL_PCT", "P99_TOL_PCT", "crosscheck", "crosscheck_lines", "write_crosscheck"]

MEAN_TOL_PCT = 3.0
P99_TOL_PCT = 10.0


def _r(x: float, nd: int = 4) -> float | None:
    return round(x, nd) if math.isfinite(x) else None


def crosscheck(virtual: Path, realtime: Path) -> dict[str, Any]:
    """Each policy of both runs: mean and p99, realtime against virtual, paired by request."""
    vmeta, vtok, _, _ = load_run(virtual)
    rmeta, rtok, _, _ = load_run(realtime)
    policies = [p for p in vmeta.labels if p in rmeta.labels]
    out: dict[str, Any] = {"virtual": str(virtual.name), "realtime": str(realtime.name),
                           "realtime_time_dilation": rmeta.time_dilation,
                           "tolerance_pct": {"mean": MEAN_TOL_PCT, "p99": P99_TOL_PCT},
                           "policies": {}}
    for policy in policies:
        a = [t for t in vtok if t.policy == policy]
        b = [t for t in rtok if t.policy == policy]
        entry: dict[str, Any] = {}
        for metric, key, tol in (("mean_latency", "mean", MEAN_TOL_PCT),
                                 ("p99_latency", "p99", P99_TOL_PCT)):
            c = paired_compare("virtual", a, "realtime", b, metric, seed=vmeta.seed)
            entry[key] = {"virtual_ms": _r(c.value_a), "realtime_ms": _r(c.value_b),
                          "change_pct": _r(c.change_pct, 2),
                          "ci_pct": [_r(c.ci_low_pct, 2), _r(c.ci_high_pct, 2)],
                          "requests": c.n_a,
                          "within": bool(math.isfinite(c.change_pct)
                                         and abs(c.change_pct) <= tol)}
        # the realtime run's own emulated timeline (its latency less the host's lateness)
        b_emulated = [replace(t, latency_ms=t.emulated_ms) for t in b]
        c = paired_compare("virtual", a, "realtime emulated", b_emulated, "mean_latency",
                           seed=vmeta.seed)
        entry["emulated_mean"] = {"virtual_ms": _r(c.value_a), "realtime_ms": _r(c.value_b),
                                  "change_pct": _r(c.change_pct, 2),
                                  "ci_pct": [_r(c.ci_low_pct, 2), _r(c.ci_high_pct, 2)]}
        measured = [t for t in b if t.ok and not t.warmup]
        total = sum(t.latency_ms for t in measured)
        entry["realtime_overhead_share"] = (
            _r(sum(t.overhead_ms for t in measured) / total) if total > 0 else None)
        out["policies"][policy] = entry
    out["agree"] = bool(out["policies"]) and all(
        e["mean"]["within"] and e["p99"]["within"] for e in out["policies"].values())
    return out


def crosscheck_lines(data: dict[str, Any]) -> list[str]:
    """A markdown table of the comparison, with the verdict."""
    lines = ["| policy | mean virtual ms | mean realtime ms | change % [95% CI] | "
             "p99 virtual ms | p99 realtime ms | change % [95% CI] | realtime host share | "
             "realtime emulated mean: change % [95% CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy, e in data["policies"].items():
        cells = [policy]
        for key in ("mean", "p99"):
            m = e[key]
            lo, hi = m["ci_pct"]
            mark = "" if m["within"] else " **beyond**"
            cells += [str(m["virtual_ms"]), str(m["realtime_ms"]),
                      f"{m['change_pct']:+.2f} [{lo}, {hi}]{mark}"
                      if m["change_pct"] is not None else "n/a"]
        share = e["realtime_overhead_share"]
        cells.append("n/a" if share is None else f"{100 * share:.1f}%")
        em = e["emulated_mean"]
        cells.append("n/a" if em["change_pct"] is None else
                     f"{em['change_pct']:+.2f} [{em['ci_pct'][0]}, {em['ci_pct'][1]}]")
        lines.append("| " + " | ".join(cells) + " |")
    tol = data["tolerance_pct"]
    verdict = ("the clocks agree" if data["agree"] else "the clocks DISAGREE")
    lines += ["", f"Realtime at time dilation {data['realtime_time_dilation']:g} against "
                  f"virtual time, paired by request: {verdict} (mean within {tol['mean']:g}%, "
                  f"p99 within {tol['p99']:g}%). The realtime run's host share is what "
                  f"its host added to each token; virtual time has none, so a realtime mean "
                  f"above the virtual one by share / (1 - share) is the host, not the mesh; the "
                  f"last column compares the realtime run's emulated timeline (its latency "
                  f"less that share) with virtual time."]
    return lines


def write_crosscheck(out: Path, data: dict[str, Any]) -> Path:
    (out / "crosscheck.json").write_text(json.dumps(data, indent=1) + "\n")
    path = out / "crosscheck.md"
    path.write_text("# Virtual against real time\n\n" + "\n".join(crosscheck_lines(data))
                    + "\n")
    return path
