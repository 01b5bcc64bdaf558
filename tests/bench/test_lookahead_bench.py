"""`moemesh bench lookahead`: the barrier's share of an emulated ms is its cost over the
lookahead, one partition needs none, and a short run measures real barriers and prints JSON of
the agreed shape."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from bench.lookahead import (
    add_arguments,
    barrier_costs_ms,
    main,
    measure_barriers,
    rows,
    topologies,
)
from netem.spec import LinkSpec
from orchestrator.cli import build_parser
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles


def two_pairs() -> Topology:
    """a-b and c-d 1 ms apart inside, 4 ms across."""
    nodes = [Node(n, builtin_profiles()["tiny-edge"]) for n in "abcd"]
    inside = {("a", "b"): LinkSpec(delay_ms=1.0), ("c", "d"): LinkSpec(delay_ms=1.0)}
    return Topology.build(nodes, default=LinkSpec(delay_ms=4.0), symmetric=inside, name="pairs")


def test_a_window_barrier_costs_its_cost_over_the_lookahead() -> None:
    costs = barrier_costs_ms({"shm_us": 2.0, "tcp_loopback_us": 10.0}, lan_rtt_ms=(0.2, 0.5))
    assert costs == pytest.approx({"shm": 0.002, "tcp_lo": 0.01, "lan0.2": 0.202,
                                   "lan0.5": 0.502})
    one, two, four = rows([two_pairs()], [1, 2, 4], costs)
    assert one["lookahead_ms"] is None and one["windows_per_s"] == 0.0
    assert one["lan0.5_share"] == 0.0 and one["partitions"] == 1
    assert two["lookahead_ms"] == 4.0 and two["sizes"] == [2, 2] and two["balance"] == 1.0
    assert two["windows_per_s"] == 250.0
    assert two["lan0.5_share"] == pytest.approx(0.502 / 4, abs=1e-4)
    assert two["lan0.5_ms_per_s"] == pytest.approx(250 * 0.502, abs=0.01)
    assert four["lookahead_ms"] == 1.0 and four["lan0.2_share"] == pytest.approx(0.202)
    # a given load (a placement's) replaces the equal one: a heavy pair is split for balance
    (heavy,) = rows([two_pairs()], [2], costs, loads=[{"a": 3, "b": 3, "c": 1, "d": 1}])
    assert heavy["sizes"] == [2, 2] and heavy["lookahead_ms"] == 1.0 and heavy["balance"] == 1.0


def test_the_topologies_are_the_shipped_ones_and_bench_scales() -> None:
    names = [t.name for t in topologies((6,))]
    assert "paper10" in names and "edge5" in names
    assert names[-1] == "random-6n-seed31-tiny"


def test_the_flags_and_the_moemesh_target() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.ks == [1, 2, 4, 8, 16] and args.random == [40, 100] and args.load == "equal"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ks", "0,2"])
    cli = build_parser().parse_args(["bench", "lookahead", "--ks", "1,2", "--json"])
    assert cli.ks == [1, 2] and cli.json


def test_a_short_run_measures_barriers_and_prints_json(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    b = measure_barriers(rounds=300, repeats=1)
    for key in ("shm_us", "futex_us", "tcp_loopback_us"):
        assert 0 < b[key] < 1e5 and math.isfinite(b[key]) and len(b["runs"][key]) == 1
    assert main(rounds=200, repeats=1, ks=(1, 2), random_nodes=(6,), load="users",
                as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"barrier_us", "costs_ms", "load", "rows"} and doc["load"] == "users"
    assert {r["k"] for r in doc["rows"]} == {1, 2}
    assert {"lookahead_ms", "balance", "windows_per_s", "lan0.5_share"} <= set(doc["rows"][0])
