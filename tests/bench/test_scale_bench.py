"""`moemesh bench scale --json`: each point is a valid scenario (random mesh, tiny-moe scaled,
batching as asked), and a small point runs to figures of the agreed shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.scale import (
    add_arguments,
    clock_floor_speedup,
    main,
    scenario_data,
    watch_interval_s,
)
from orchestrator.scenario.scenario import scenario_from_data
from orchestrator.scenario.yamlio import Loc


@pytest.mark.parametrize("mode", ["none", "iteration"])
def test_a_point_is_a_valid_scenario(mode: str) -> None:
    data = scenario_data(6, 2.4, mode, 5.0, max_rows=64)
    s = scenario_from_data(data, Loc("scale.yaml"), Path("."))
    assert len(s.topology.nodes) == 6 and s.workload.rate_rps == 2.4
    assert s.virtual and s.policies == ("hetroute",)
    assert s.batching.mode == mode and (mode == "none" or s.batching.max_rows == 64)


def test_the_memory_watcher_samples_a_large_mesh_less_often() -> None:
    """Each sample reads every node's smaps_rollup (~5 ms of CPU each): at a fixed 0.5 s a
    100-node mesh lost a core to its own measurement."""
    assert watch_interval_s(3) == 0.5
    assert watch_interval_s(100) == pytest.approx(10.0)
    assert 100 * 0.005 / watch_interval_s(100) <= 0.05  # the watcher: <= 5% of one core


def test_the_clock_floor_is_virtual_time_over_the_rounds_it_took() -> None:
    # 2,000 advances of 100 us each: 0.2 s of wall for 1 s of virtual time
    assert clock_floor_speedup({"advances": 2000, "virtual_s": 1.0}, 100.0) == 5.0
    assert clock_floor_speedup({"advances": 0, "virtual_s": 1.0}, 100.0) is None
    assert clock_floor_speedup({"advances": 10, "virtual_s": 1.0}, 0.0) is None


def test_workers_are_the_reference_or_one_partition() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).workers == [None, 1]
    assert parser.parse_args(["--workers", "processes"]).workers == [None]
    with pytest.raises(SystemExit):
        parser.parse_args(["--workers", "2"])
    assert scenario_data(4, 1.6, "none", 2.0, workers=1)["workers"] == 1
    assert "workers" not in scenario_data(4, 1.6, "none", 2.0)


@pytest.mark.slow
def test_a_small_grid_prints_points_of_the_agreed_shape(capsys: pytest.CaptureFixture) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args(["--json", "--nodes", "3", "--duration", "2s",
                                   "--batching", "iteration"])) == 0
    points = json.loads(capsys.readouterr().out)
    assert len(points) == 2  # a process a node, then the same point in one partition
    p, one = points
    assert (p["nodes"], p["rate_rps"], p["batching"], p["workers"]) == (3, 1.2, "iteration",
                                                                          None)
    # the same emulated run: its tokens and virtual time; its speed against the reference
    assert (one["workers"], one["tokens"], one["virtual_s"]) == (1, p["tokens"], p["virtual_s"])
    assert one["speedup_vs_processes"] == pytest.approx(
        one["virtual_speedup"] / p["virtual_speedup"], rel=1e-2)
    assert one["pss_mib_per_node"] > 0 and one["lookahead_ms"] is None
    assert p["speedup_vs_processes"] is None and p["lookahead_ms"] is None
    assert p["tokens"] > 0 and p["virtual_speedup"] > 0 and p["cpu_ms_per_token"] > 0
    assert p["advances_per_token"] > 0 and p["floor_ms_per_token"] > 0
    assert p["wakes_per_advance"] >= 1 and p["reports_per_advance"] >= p["wakes_per_advance"]
    # the run did more than move its clock, so it is slower than the clock's floor
    assert p["clock_round_us"] > 0 and p["clock_floor_speedup"] > p["virtual_speedup"]
    assert p["pss_mib_per_node"] is None or p["pss_mib_per_node"] > 0
    assert p["watch_interval_s"] == 0.5 and p["watch_cpu_s"] >= 0
