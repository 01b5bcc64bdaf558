"""Each node's event-loop lag during one arm, for run.json (`meta["loop_lag"]`).

A node whose event loop is blocked (a control action done on it, a GC pause, a long torch call)
delays every request it serves; the nodes sample how late their loops wake
(`services.looplag`, `GET /v1/looplag`) and the runner reads each node's samples of the arm's
workload after the arm. Stored per arm and node:

    {"p99_ms": float, "max_ms": float, "over_5ms_frac": float, "samples": int,
     "series": [[t_s, lag_ms], ...], "intervals": [[from_s, to_s, max_lag_ms], ...]}

`t_s` are scenario seconds since the arm's workload start (wall seconds / time dilation,
counted from the same instant as the rows' `sent_s` / `done_s`); `lag_ms` are WALL
milliseconds (the host's stall, not scaled). `series` keeps the samples later than
`SERIES_MIN_MS` plus the worst sample of every scenario second, so it stays small.
`over_5ms_frac` is the share of the workload's time during which the loop was more than 5 ms
late; `intervals` are the spans (scenario seconds) during which it was: a sample (t, lag) means
the loop could not run due work from t - lag to t. A node that could not be read has
{"error": why} instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from netem.timing import now

__all__ = ["LAG_OVER_MS", "SERIES_MIN_MS", "collect_loop_lag", "lag_intervals", "worst_node"]

SERIES_MIN_MS = 1.0
LAG_OVER_MS = 5.0


def lag_intervals(series: list[list[float]], tdf: float, over_ms: float = LAG_OVER_MS
                  ) -> list[list[float]]:
    """[[from_s, to_s, max_lag_ms]]: where the loop was later than `over_ms` (scenario
    seconds; overlapping spans merged)."""
    spans = sorted((t - lag / 1e3 / tdf, t, lag) for t, lag in series if lag > over_ms)
    out: list[list[float]] = []
    for lo, hi, lag in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
            out[-1][2] = max(out[-1][2], lag)
        else:
            out.append([lo, hi, lag])
    return [[round(a, 4), round(b, 4), round(c, 3)] for a, b, c in out]


def _node_entry(window: Mapping[str, Any], start: float, tdf: float) -> dict[str, Any]:
    if "error" in window:
        return {"error": str(window["error"])}
    points = {(float(t), float(lag)) for t, lag in window.get("samples", ())}
    points |= {(float(t), float(lag)) for t, lag in window.get("peaks", ())}
    series = [[round((t - start) / tdf, 4), round(lag, 3)] for t, lag in sorted(points)]
    return {"p99_ms": float(window.get("p99_ms", 0.0)),
            "max_ms": float(window.get("max_ms", 0.0)),
            "over_5ms_frac": float(window.get("over_5ms_frac", 0.0)),
            "samples": int(window.get("count", 0)),
            "series": series, "intervals": lag_intervals(series, tdf)}


async def collect_loop_lag(mesh: Any, start: float, tdf: float, end: float | None = None
                           ) -> dict[str, dict[str, Any]] | None:
    """Every node's lag in the arm's workload (`start`..`end`, `netem.timing.now()` seconds;
    end None: now); None when the target cannot say (no `loop_lag`)."""
    read = getattr(mesh, "loop_lag", None)
    if read is None:
        return None
    windows = await read(start, now() if end is None else end, min_ms=SERIES_MIN_MS,
                         every_s=tdf)
    return {name: _node_entry(w, start, tdf) for name, w in sorted(windows.items())}


def worst_node(per_node: Mapping[str, Mapping[str, Any]]) -> dict[str, float] | None:
    """{"p99", "max"} (ms) of the worst node of one arm (what summary.json's `loop_lag_ms`
    shows), None without readings."""
    ok = [v for v in per_node.values() if "error" not in v]
    if not ok:
        return None
    return {"p99": max(float(v["p99_ms"]) for v in ok),
            "max": max(float(v["max_ms"]) for v in ok)}
