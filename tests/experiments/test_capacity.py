"""Capacity mode (experiments.capacity) on given figures: the climb, the points, the files.

No mesh here: the search runs on attainment figures written down in the test, and the files
are drawn from a capacity.json made of them. The live run is test_capacity_live.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.capacity import (
    STEADY_MAX,
    STEADY_SPAN_S,
    Figure,
    at_load,
    capacity_arms,
    capacity_data,
    capacity_lines,
    capacity_of,
    default_loads,
    figures_of,
    rebuild_capacity,
    share_interval,
    should_stop,
    steady_requests,
    write_capacity,
)
from experiments.run.rows import RequestRow, write_rows
from orchestrator.mesh.faults import Fault
from orchestrator.runclock import RunClock
from orchestrator.scenario.arms import Arm
from tests.experiments.conftest import small_scenario
from tests.helpers import moemesh


def fig(load: float, share: float, *, faithful: bool = True, tok_s: float | None = None,
        measured: int = 0) -> Figure:
    return Figure(load, 2.0 * load, share, 16.0 * load if tok_s is None else tok_s, 20.0 * load,
                  40.0 * load, 0.01, 100, 0, faithful, () if faithful else ("host",),
                  measured=measured)


def test_the_share_interval_is_wilsons() -> None:
    lo, hi = share_interval(9, 10)  # the textbook value: 0.596..0.982
    assert (round(lo, 3), round(hi, 3)) == (0.596, 0.982)
    assert share_interval(0, 20)[0] == 0.0 and 0 < share_interval(0, 20)[1] < 0.2
    assert share_interval(20, 20)[1] == 1.0 and 0.8 < share_interval(20, 20)[0] < 1.0
    with pytest.raises(ValueError, match="k=3, n=2"):
        share_interval(3, 2)


def test_a_capacity_is_bracketed_by_the_loads_it_surely_passed_and_missed() -> None:
    """Sure: the Wilson interval clears the target. 100 of 100 surely pass 0.9; 95 of 100
    pass but not surely (0.888..0.978); 80 of 100 surely miss (0.711..0.867); 85 of 100
    miss but not surely (0.767..0.907)."""
    figs = [fig(10, 1.0, measured=100), fig(20, 0.95, measured=100),
            fig(40, 0.85, measured=100), fig(80, 0.8, measured=100)]
    cap = capacity_of("a", figs, 0.9)
    assert (cap.load, cap.sure_load, cap.sure_miss) == (20, 10, 80)
    assert capacity_lines(capacity_data("s", "rate", [
        {"load": f.load, "policies": {"a": f.to_json()}} for f in figs], 0.9, 300.0,
        {"load": 1.0, "time_dilation": 1.0}, 16))[2].split(" | ")[4] == "[10, 80)"
    none = capacity_of("b", [fig(10, 0.85, measured=100)], 0.9)  # nothing sure either way
    assert (none.sure_load, none.sure_miss) == (None, None)
    unmeasured = capacity_of("c", [fig(10, 1.0)], 0.9)  # no count: nothing is sure
    assert (unmeasured.load, unmeasured.sure_load) == (10, None)


def test_capacity_is_the_last_load_before_the_first_miss() -> None:
    figs = [fig(40, 0.5), fig(10, 1.0), fig(20, 0.95)]  # any order: sorted by load
    cap = capacity_of("hetroute", figs, 0.9)
    assert (cap.load, cap.limit, cap.limit_load) == (20, "slo", 40)
    assert cap.throughput_tok_s == 16.0 * 20
    # 0.95 at 20 and 0.5 at 40: 0.9 is crossed a ninth of the way, at 20 + 20 / 9
    assert cap.crossing == pytest.approx(20 + 20 / 9)


def test_a_pass_above_a_miss_does_not_count() -> None:
    cap = capacity_of("greedy", [fig(10, 0.95), fig(20, 0.6), fig(40, 0.92)], 0.9)
    assert cap.load == 10 and cap.limit == "slo" and cap.limit_load == 20


def test_a_host_distorted_point_is_skipped_not_judged() -> None:
    figs = [fig(10, 1.0), fig(20, 0.1, faithful=False), fig(40, 0.95)]
    cap = capacity_of("prism", figs, 0.9)
    assert (cap.load, cap.limit, cap.skipped) == (40, "ladder", (20,))
    # nothing faithful above the last pass: the host, not the mesh, ended the climb
    top = capacity_of("prism", figs[:2], 0.9)
    assert (top.load, top.limit, top.limit_load, top.crossing) == (10, "host", 20, None)


def test_every_load_passing_and_the_first_failing() -> None:
    top = capacity_of("a", [fig(10, 1.0), fig(20, 0.9)], 0.9)  # the target itself passes
    assert (top.load, top.limit, top.limit_load) == (20, "ladder", None)
    low = capacity_of("b", [fig(10, 0.4), fig(20, 0.1)], 0.9)
    assert (low.load, low.throughput_tok_s, low.crossing, low.limit) == (None, None, None, "slo")
    nan = capacity_of("c", [fig(10, math.nan)], 0.9)  # no measured request: not a pass
    assert nan.load is None and nan.limit == "slo"


def test_the_climb_stops_when_no_policy_meets_the_target() -> None:
    assert not should_stop({"a": fig(10, 0.95), "b": fig(10, 0.2)}, 0.9)
    assert should_stop({"a": fig(40, 0.85), "b": fig(40, 0.2)}, 0.9)
    assert not should_stop({"a": fig(40, 0.2, faithful=False), "b": fig(40, 0.2)}, 0.9)


def test_a_load_point_scales_the_dilation_and_counts_requests() -> None:
    sc = replace(small_scenario(), time_dilation=2.0, auto_dilation=True,
                 faults=(Fault(1.0, "link-down", ("edge1", "edge2")),))
    base = sc.workload.rate_rps
    hi = at_load(sc, 4 * base, base_load=base, base=RunClock(2.0), requests=20)
    assert hi.workload.rate_rps == 4 * base and hi.time_dilation == 8.0
    assert hi.workload.requests == 20 and hi.workload.duration_s is None
    # the warm-up is the first fifth of the span: 20 requests at 20 req/s take 1 s
    assert hi.workload.warmup_s == pytest.approx(0.2 * 20 / (4 * base))
    assert hi.faults == () and not hi.auto_dilation
    low = at_load(sc, base / 2, base_load=base, base=RunClock(2.0))
    assert low.time_dilation == 2.0 and low.workload.duration_s == sc.workload.duration_s
    with pytest.raises(ValueError, match="load"):
        at_load(sc, 0, base_load=base, base=RunClock(2.0))


def test_in_virtual_time_a_load_is_undilated_and_held_not_a_burst() -> None:
    sc = replace(small_scenario(), time_dilation=2.0, clock="virtual")
    base = sc.workload.rate_rps
    hi = at_load(sc, 40 * base, base_load=base, base=RunClock(2.0, virtual=True), requests=30)
    assert hi.time_dilation == 1.0  # the host's work takes no emulated time
    assert steady_requests(10.0, 16) == 16  # a low load: the ladder's own count
    assert steady_requests(160.0, 16) == math.ceil(160 * STEADY_SPAN_S)  # 0.6 s of arrivals
    assert steady_requests(1e6, 16) == STEADY_MAX
    assert steady_requests(8, 16, "concurrency") == 32  # four requests per user


def test_a_closed_loop_point_sets_whole_users() -> None:
    sc = small_scenario(arrival="closed", rate_rps=None, concurrency=2)
    pt = at_load(sc, 8, base_load=2, base=RunClock(1.0), requests=12)
    assert pt.workload.concurrency == 8 and pt.time_dilation == 4.0
    assert pt.workload.requests == 12 and pt.workload.warmup_s == sc.workload.warmup_s
    with pytest.raises(ValueError, match="concurrency"):
        at_load(sc, 2.5, base_load=2, base=RunClock(1.0))
    assert default_loads(sc) == [10.0, 40.0, 80.0]
    assert default_loads(small_scenario()) == [25.0, 100.0, 200.0]


def test_exact_and_sensitivity_variants_are_not_measured() -> None:
    sc = small_scenario()
    arms = (Arm("exact", "exact"), Arm("hetroute", "hetroute"),
            Arm("edgeshard", "greedy", placement="layer-shard"), Arm("greedy", "greedy"),
            Arm("hetroute-budget-3", "hetroute", budget_pct=3.0),
            Arm("hetroute-r1", "hetroute", redundancy=1.0))
    assert [a.label for a in capacity_arms(arms, sc)] == ["hetroute", "edgeshard", "greedy"]
    chosen = capacity_arms(arms, sc, chosen=True)  # named with --policies: all but exact
    assert [a.label for a in chosen] == [a.label for a in arms[1:]]
    with pytest.raises(ValueError, match="only exact"):
        capacity_arms(arms[:1], sc)


def _summary(share: float, overhead: float = 0.01, lag: float = 0.0) -> dict:
    return {"policies": {"hetroute": {
        "tokens": 90, "failed_tokens": 2, "latency_ms": {"mean": 30.0, "p99": 90.0},
        "throughput_tok_s": 320.0, "slo_share": share, "overhead_share": overhead,
        "loop_lag_ms": {"p99": 1.0, "max": 7.0, "over_5ms_frac": lag, "node": "edge5"}}}}


def test_a_policy_the_host_distorted_is_not_faithful_at_that_load() -> None:
    ok = figures_of(20, RunClock(40.0), _summary(0.95))["hetroute"]
    assert ok.faithful and ok.passes(0.9) and ok.time_dilation == 40.0
    busy = figures_of(20, RunClock(40.0), _summary(0.95, overhead=0.08))["hetroute"]
    assert not busy.faithful and not busy.passes(0.9) and "8.0%" in busy.reasons[0]
    # a late event loop is said beside the point, in scenario time too; what it did to the
    # tokens is in their overhead share, which decides (at factor 40, 7 ms is 0.17 ms)
    lagged = figures_of(20, RunClock(40.0), _summary(0.95, lag=0.03))["hetroute"]
    assert lagged.faithful and lagged.reasons == ()
    assert "edge5's event loop" in lagged.notes[0] and "0.17 scenario ms" in lagged.notes[0]


def test_capacity_files(tmp_path: Path) -> None:
    sc = small_scenario()
    points = []
    for load, a, b in ((10, 1.0, 0.95), (20, 0.92, 0.6), (40, 0.3, 0.1)):
        figs = {"hetroute": fig(load, a), "greedy": fig(load, b, faithful=load < 40)}
        points.append({"load": load, "time_dilation": 2.0 * load, "folder": f"rate={load}",
                       "wall_s": 1.0, "faithful": True,
                       "policies": {k: f.to_json() for k, f in figs.items()}})
    data = capacity_data(sc.name, "rate", points, 0.9, 300.0,
                         {"load": 5.0, "time_dilation": 1.0}, 16)
    data["wall_s"] = 3.0
    plot = write_capacity(tmp_path, data)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    back = json.loads((tmp_path / "capacity.json").read_text())
    assert back["capacity"]["hetroute"]["load"] == 20
    assert back["capacity"]["greedy"]["load"] == 10
    assert back["capacity"]["greedy"]["limit"] == "slo"
    md = (tmp_path / "capacity.md").read_text()
    assert "| hetroute | 20 | 320 |" in md and "missed the SLO target at 40" in md
    assert "| 40 | greedy | 10% |" in md and "NO: host" in md


def test_capacity_flags_are_checked_before_anything_runs(tmp_path: Path) -> None:
    scenario = Path(__file__).resolve().parents[2] / "experiments/scenarios/quickstart.yaml"
    assert moemesh("run", str(scenario), "--loads", "1,2") == 2
    assert moemesh("run", str(scenario), "--capacity", "--duration", "5s") == 2
    assert moemesh("run", str(scenario), "--capacity", "--loads", "1,x",
                   "--out", str(tmp_path)) == 2
    assert moemesh("run", str(scenario), "--capacity", "--slo-target", "1.5",
                   "--out", str(tmp_path)) == 2


def test_a_capacity_folder_is_redrawn_from_its_loads(tmp_path: Path) -> None:
    """`moemesh report DIR` on a capacity folder: each load's summary.json read again."""
    points = []
    for load, share in ((10, 0.95), (20, 0.5)):
        (tmp_path / f"rate={load}").mkdir()
        (tmp_path / f"rate={load}" / "summary.json").write_text(json.dumps(
            {"faithful": True, **_summary(share)}))
        points.append({"load": load, "time_dilation": 2.0 * load, "folder": f"rate={load}",
                       "wall_s": 1.0, "faithful": True, "policies": {}})
    stale = capacity_data("small", "rate", points, 0.9, 300.0,
                          {"load": 5.0, "time_dilation": 1.0}, 16)
    (tmp_path / "capacity.json").write_text(json.dumps(stale))
    # 4 requests of 1 s each: a steady state would hold 10 at once at 10 req/s, 20 at 20
    for load, count in ((10, 24), (20, 4)):
        write_rows(tmp_path / f"rate={load}" / "requests.csv",
                   [RequestRow("hetroute", i, "edge1", -1, False, 0.05 * i, 0.05 * i,
                               0.05 * i + 1.0, 8, 4, 4, 0, 10.0, 1000.0, "")
                    for i in range(count)], RequestRow)
    assert moemesh("report", str(tmp_path)) == 0
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert data["capacity"]["hetroute"]["load"] == 10
    assert data["capacity"]["hetroute"]["limit_load"] == 20
    low, high = (p["policies"]["hetroute"] for p in data["points"])
    assert (low["in_flight"], low["requests"], low["burst"]) == (10.0, 24, False)
    assert (high["in_flight"], high["requests"], high["burst"]) == (20.0, 4, True)
    assert (low["measured"], high["measured"]) == (24, 4)  # none in the warm-up
    md = (tmp_path / "capacity.md").read_text()
    assert "burst: 4 sent, ~20 in flight" in md and "| hetroute | 10 | 320 |" in md
    (tmp_path / "rate=10" / "requests.csv").unlink()  # unknown: not called a burst
    rebuild_capacity(tmp_path)
    low = json.loads((tmp_path / "capacity.json").read_text())["points"][0]
    assert (low["policies"]["hetroute"]["in_flight"], low["policies"]["hetroute"]["burst"]) == (
        None, False)
    assert (tmp_path / "capacity.png").is_file()


def test_a_capacity_reached_in_a_burst_says_so(tmp_path: Path) -> None:
    figs = {"hetroute": replace(fig(10, 1.0), in_flight=10.0, requests=4)}
    point = {"load": 10, "time_dilation": 20.0, "folder": "rate=10", "wall_s": 1.0,
             "faithful": True, "policies": {k: f.to_json() for k, f in figs.items()}}
    data = capacity_data("small", "rate", [point], 0.9, 300.0,
                         {"load": 5.0, "time_dilation": 1.0}, 4)
    assert any("| hetroute | 10 (burst) | 160 |" in line for line in capacity_lines(data))
