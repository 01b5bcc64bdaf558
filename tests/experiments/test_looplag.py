"""What run.json keeps of the nodes' event-loop lag (experiments.run.looplag) and the plot's
marks."""

from __future__ import annotations

from typing import Any

import pytest

from experiments.report.plots import lag_spans
from experiments.run.looplag import collect_loop_lag, lag_intervals, worst_node
from orchestrator.runclock import RunClock


class FakeMesh:
    """Answers loop_lag as LiveMesh does: node → the GET /v1/looplag window."""

    def __init__(self, windows: dict[str, dict[str, Any]]) -> None:
        self.windows = windows
        self.asked: list[tuple] = []

    async def loop_lag(self, since: float, until: float | None = None, *, min_ms: float = 0.0,
                       every_s: float | None = None) -> dict[str, dict[str, Any]]:
        self.asked.append((since, until, min_ms, every_s))
        return self.windows


def window(samples: list[list[float]], peaks: list[list[float]], **summary: float
           ) -> dict[str, Any]:
    return {"samples": samples, "peaks": peaks, "count": 300, "p99_ms": 2.0, "max_ms": 40.0,
            "over_5ms_frac": 0.01, **summary}


async def test_series_are_scenario_seconds_from_the_workload_start() -> None:
    start, tdf = 1000.0, 2.0  # perf_counter of the driver's start; wall = 2 x scenario
    mesh = FakeMesh({
        "edge2": {"error": "node down"},
        "edge1": window([[1010.0, 40.0], [1010.5, 1.5]], [[1001.0, 0.6], [1010.0, 40.0]]),
    })
    got = await collect_loop_lag(mesh, start, RunClock(tdf), end=1020.0)
    assert mesh.asked == [(1000.0, 1020.0, 1.0, 2.0)]  # > 1 ms plus the worst per scenario s
    assert list(got) == ["edge1", "edge2"] and got["edge2"] == {"error": "node down"}
    e1 = got["edge1"]
    assert e1["series"] == [[0.5, 0.6], [5.0, 40.0], [5.25, 1.5]]  # merged, deduplicated
    assert (e1["p99_ms"], e1["max_ms"], e1["over_5ms_frac"], e1["samples"]) == (2.0, 40.0,
                                                                                0.01, 300)
    # 40 wall ms late at scenario 5.0 s: the loop stalled from 5.0 - 0.04 / 2 to 5.0
    assert e1["intervals"] == [[pytest.approx(4.98), 5.0, 40.0]]
    assert worst_node(got) == {"p99": 2.0, "max": 40.0}


async def test_a_target_without_loop_lag_records_none() -> None:
    assert await collect_loop_lag(object(), 0.0, RunClock()) is None


def test_intervals_merge_and_the_plot_joins_nodes() -> None:
    series = [[1.0, 3.0], [2.0, 20.0], [2.01, 15.0], [4.0, 6.0]]
    assert lag_intervals(series, RunClock(1.0)) == [[1.98, 2.01, 20.0], [3.994, 4.0, 6.0]]
    per_node = {"a": {"intervals": [[1.0, 1.5, 9.0]]}, "b": {"intervals": [[1.4, 2.0, 7.0]]},
                "c": {"error": "node down"}}
    assert lag_spans(per_node) == [(1.0, 2.0)]
    assert lag_spans(None) == []
    assert worst_node({"c": {"error": "x"}}) is None


def test_the_latency_plot_marks_lag_spans(tmp_path) -> None:
    from experiments.report import plots
    from tests.experiments.conftest import make_rows

    tokens, _ = make_rows("hetroute", 20.0, n_requests=10)
    lag = {"hetroute": {"edge1": {"intervals": [[2.0, 2.02, 30.0]]}}}
    path = plots.latency_over_time({"hetroute": tokens}, {}, tmp_path / "t.png",
                                   lag_by_policy=lag)
    assert path.stat().st_size > 1000


async def test_a_long_arm_is_read_in_chunks_and_merged_and_keeps_lost() -> None:
    """`ArmLag` reads each node's window every chunk_s while the arm runs, so an arm longer
    than the node's ring (~11 min) is covered whole; chunks merge (counts and over-5-ms time
    added, max of maxima, p99 the worst chunk's) and a chunk that lost samples says so."""
    import asyncio

    from experiments.run.looplag import arm_lag, merge_windows

    chunks = [
        {"edge1": {**window([[1.0, 40.0]], [], count=100, p99_ms=2.0, max_ms=40.0,
                            over_5ms_frac=0.02), "since": 0.0, "until": 10.0}},
        {"edge1": {**window([[12.0, 9.0]], [], count=300, p99_ms=5.0, max_ms=9.0,
                            over_5ms_frac=0.0), "since": 10.0, "until": 40.0,
                   "lost": True}},
    ]
    merged = merge_windows([c["edge1"] for c in chunks])
    assert merged["count"] == 400 and merged["max_ms"] == 40.0 and merged["p99_ms"] == 5.0
    assert merged["over_5ms_frac"] == pytest.approx(0.02 * 10 / 40) and merged["lost"]
    assert merged["samples"] == [[1.0, 40.0], [12.0, 9.0]]
    assert merge_windows([{"error": "node down"}]) == {"error": "node down"}

    class Chunked(FakeMesh):
        async def loop_lag(self, since, until=None, *, min_ms=0.0, every_s=None):
            self.asked.append((since, until))
            return chunks[min(len(self.asked), 2) - 1]

    mesh = Chunked({})
    async with arm_lag(mesh, RunClock(1.0), chunk_s=0.05) as lagging:
        await asyncio.sleep(0.08)  # one chunk read during the arm
    got = await lagging.finish(0.0)
    assert len(mesh.asked) == 2 and mesh.asked[0][1] == mesh.asked[1][0]  # back to back
    assert got["edge1"]["lost"] is True and got["edge1"]["samples"] == 400
