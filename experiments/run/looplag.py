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

The whole arm is covered, however long: a node's ring holds ~11 minutes of samples, so
`ArmLag` reads each node's window every `CHUNK_S` while the arm runs and merges the chunks at
its end (count and the over-5-ms time added up, max of maxima; p99 is the worst chunk's p99,
an upper bound). A chunk whose start the ring had already overwritten says `lost`; the merged
entry keeps `"lost": true` and `experiments.analysis.faithful` marks the arm for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from netem.timing import now
from orchestrator.runclock import REAL, RunClock

__all__ = ["CHUNK_S", "LAG_OVER_MS", "SERIES_MIN_MS", "ArmLag", "arm_lag", "collect_loop_lag",
           "lag_intervals", "merge_windows", "worst_node"]

SERIES_MIN_MS = 1.0
LAG_OVER_MS = 5.0
CHUNK_S = 120.0  # wall seconds between reads: far inside the ring's ~11 minutes


def lag_intervals(series: list[list[float]], run_clock: RunClock = REAL,
                  over_ms: float = LAG_OVER_MS) -> list[list[float]]:
    """[[from_s, to_s, max_lag_ms]]: where the loop was later than `over_ms` (scenario
    seconds; overlapping spans merged)."""
    spans = sorted((t - run_clock.to_scenario_s(lag / 1e3), t, lag)
                   for t, lag in series if lag > over_ms)
    out: list[list[float]] = []
    for lo, hi, lag in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
            out[-1][2] = max(out[-1][2], lag)
        else:
            out.append([lo, hi, lag])
    return [[round(a, 4), round(b, 4), round(c, 3)] for a, b, c in out]


def _node_entry(window: Mapping[str, Any], start: float, run_clock: RunClock
                ) -> dict[str, Any]:
    if "error" in window:
        return {"error": str(window["error"])}
    points = {(float(t), float(lag)) for t, lag in window.get("samples", ())}
    points |= {(float(t), float(lag)) for t, lag in window.get("peaks", ())}
    series = [[round(run_clock.since(start, t), 4), round(lag, 3)] for t, lag in sorted(points)]
    out = {"p99_ms": float(window.get("p99_ms", 0.0)),
           "max_ms": float(window.get("max_ms", 0.0)),
           "over_5ms_frac": float(window.get("over_5ms_frac", 0.0)),
           "samples": int(window.get("count", 0)),
           "series": series, "intervals": lag_intervals(series, run_clock)}
    if window.get("lost"):
        out["lost"] = True
    return out


def merge_windows(windows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One node's consecutive `GET /v1/looplag` windows as one (see the module docstring);
    {"error"} only when no chunk could be read. A chunk with an error (a node down by a fault,
    or dead: the supervisor reports that) adds nothing."""
    ok = [w for w in windows if "error" not in w]
    if not ok:
        return {"error": str(windows[-1]["error"]) if windows else "not read"}
    spans = [max(0.0, float(w.get("until", 0.0)) - float(w.get("since", 0.0))) for w in ok]
    total = sum(spans)
    over = sum(float(w.get("over_5ms_frac", 0.0)) * sp for w, sp in zip(ok, spans, strict=True))
    return {"count": sum(int(w.get("count", 0)) for w in ok),
            "p99_ms": max(float(w.get("p99_ms", 0.0)) for w in ok),
            "max_ms": max(float(w.get("max_ms", 0.0)) for w in ok),
            "over_5ms_frac": over / total if total > 0 else 0.0,
            "lost": any(bool(w.get("lost")) for w in ok),
            "samples": [p for w in ok for p in w.get("samples", ())],
            "peaks": [p for w in ok for p in w.get("peaks", ())]}


class ArmLag:
    """Reads every node's loop lag in chunks while an arm runs (see the module docstring)."""

    def __init__(self, mesh: Any, run_clock: RunClock, chunk_s: float = CHUNK_S) -> None:
        self.read = getattr(mesh, "loop_lag", None)
        self.run_clock = run_clock
        self.chunk_s = chunk_s
        self.since = now()
        self.chunks: list[Mapping[str, Mapping[str, Any]]] = []

    async def _chunk(self) -> None:
        assert self.read is not None
        until = now()
        self.chunks.append(await self.read(self.since, until, min_ms=SERIES_MIN_MS,
                                           every_s=self.run_clock.to_wall_s(1.0)))
        self.since = until

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.chunk_s)
            await self._chunk()

    async def finish(self, start: float) -> dict[str, dict[str, Any]] | None:
        """The last chunk, then every node's entry for run.json (times from `start`, the
        workload's start); None when the target cannot say."""
        if self.read is None:
            return None
        await self._chunk()
        names = sorted({n for c in self.chunks for n in c})
        return {name: _node_entry(merge_windows([c[name] for c in self.chunks if name in c]),
                                  start, self.run_clock) for name in names}


@contextlib.asynccontextmanager
async def arm_lag(mesh: Any, run_clock: RunClock, chunk_s: float = CHUNK_S
                  ) -> AsyncIterator[ArmLag]:
    """An `ArmLag` reading in the background for the block's length; call `finish` after."""
    lag = ArmLag(mesh, run_clock, chunk_s)
    task = asyncio.create_task(lag.run(), name="loop-lag") if lag.read is not None else None
    try:
        yield lag
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def collect_loop_lag(mesh: Any, start: float, run_clock: RunClock,
                           end: float | None = None) -> dict[str, dict[str, Any]] | None:
    """Every node's lag in the arm's workload (`start`..`end`, `netem.timing.now()` seconds;
    end None: now); None when the target cannot say (no `loop_lag`)."""
    read = getattr(mesh, "loop_lag", None)
    if read is None:
        return None
    windows = await read(start, now() if end is None else end, min_ms=SERIES_MIN_MS,
                         every_s=run_clock.to_wall_s(1.0))
    return {name: _node_entry(w, start, run_clock) for name, w in sorted(windows.items())}


def worst_node(per_node: Mapping[str, Mapping[str, Any]]) -> dict[str, float] | None:
    """{"p99", "max"} (ms) of the worst node of one arm (what summary.json's `loop_lag_ms`
    shows), None without readings."""
    ok = [v for v in per_node.values() if "error" not in v]
    if not ok:
        return None
    return {"p99": max(float(v["p99_ms"]) for v in ok),
            "max": max(float(v["max_ms"]) for v in ok)}
