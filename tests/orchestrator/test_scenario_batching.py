"""A scenario's `batching:` key (router.batching): errors that name the field, round trips, and
what the routers are told (PUT /v1/mesh), for the arms whose dense part is at home only."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.scenario import scenario_from_data, scenario_to_data
from orchestrator.scenario.yamlio import InputError, Loc, dump_yaml, load_yaml_text
from router.batching import Batching
from tests.helpers import ROOT

TOPO = """\
topology:
  nodes:
    - {name: a, profile: hetroute-s, users: 3}
    - {name: b, profile: hetroute-m, users: 1}
  defaults: {delay_ms: 2ms, rate_mbit: 1gbit}
workload: {rate_rps: 2, duration: 60s}
"""
L = TOPO.count("\n")


@pytest.mark.parametrize(("text", "expected"), [
    ("batching: {mode: continuous}\n",
     f"{L + 1}: batching.mode: must be one of none, iteration, got 'continuous'"),
    ("batching:\n  mode: iteration\n  max_rows: 0\n",
     f"{L + 3}: batching.max_rows: must be an integer >= 1, got 0"),
    ("batching: {mode: iteration, prefill_chunk: -4}\n",
     f"{L + 1}: batching.prefill_chunk: must be an integer >= 0 (0: prompts join whole), "
     "got -4"),
    ("batching: {mode: iteration, rows: 3}\n",
     f"{L + 1}: batching: unknown field(s) rows; known: mode, max_rows, prefill_chunk"),
    ("batching: iteration\n",
     f"{L + 1}: batching: must be a mapping {{mode, max_rows, prefill_chunk}}, got 'iteration'"),
])
def test_bad_batching_keys_give_the_exact_error(tmp_path: Path, text: str,
                                                 expected: str) -> None:
    path = tmp_path / "scen.yaml"
    path.write_text(TOPO + text)
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}:{expected}"


def test_batching_round_trips_and_defaults_to_none(tmp_path: Path) -> None:
    path = tmp_path / "scen.yaml"
    path.write_text(TOPO)
    assert load_scenario(path).batching == Batching()
    assert "batching" not in scenario_to_data(load_scenario(path))  # none: as before
    path.write_text(TOPO + "batching: {mode: iteration, max_rows: 64}\n")
    s = load_scenario(path)
    assert s.batching == Batching("iteration", 64)
    back = scenario_from_data(load_yaml_text(dump_yaml(scenario_to_data(s)), "rt.yaml"),
                              Loc("rt.yaml"), Path("."))
    assert back == s


def test_the_paper_load_scenario_batches() -> None:
    s = load_scenario(ROOT / "experiments" / "scenarios" / "hetroute-paper-load.yaml")
    assert s.batching.mode == "iteration" and s.workload.rate_rps == 40.0
    shipped = load_scenario(ROOT / "experiments" / "scenarios" / "hetroute-paper.yaml")
    assert shipped.batching == Batching()  # the shipped scenario keeps its numbers


def test_routers_are_told_to_batch_only_where_the_dense_part_is_at_home(tmp_path: Path) -> None:
    from orchestrator.mesh.live import LiveMesh

    path = tmp_path / "scen.yaml"
    path.write_text(TOPO + "batching: {mode: iteration, max_rows: 64}\n")
    scenario = load_scenario(path)
    mesh = LiveMesh.__new__(LiveMesh)  # router_mesh reads only what is set below
    mesh.scenario, mesh.placement, mesh.router_settings = scenario, {}, {}
    mesh.endpoints = {n.name: _Endpoint() for n in scenario.topology.nodes}
    mesh.dense, mesh.batching = None, scenario.batching
    assert mesh.router_mesh()["batching"] == {"mode": "iteration", "max_rows": 64,
                                              "prefill_chunk": 0}
    mesh.dense = {"aggregate": True}
    assert "batching" not in mesh.router_mesh()


class _Endpoint:
    address, port = "127.0.0.1", 8000


ARMS = """\
batching: {mode: iteration, max_rows: 64}
policies:
  - hetroute
  - {policy: hetroute, batching: none, label: hetroute-unbatched}
  - {policy: greedy, batching: {mode: iteration, max_rows: 8, prefill_chunk: 4}}
  - {policy: greedy, placement: edgeshard, dense: pipeline, label: edgeshard}
"""


def test_an_arm_may_step_otherwise_than_its_scenario(tmp_path: Path) -> None:
    """`batching` of an arm: so one study pairs the same policy batched and not."""
    from orchestrator.scenario.arms import load_experiment

    path = tmp_path / "scen.yaml"
    path.write_text(TOPO + ARMS)
    scenario, arms = load_experiment(path)
    by = {a.label: a for a in arms}
    assert list(by) == ["hetroute", "hetroute-unbatched",
                        "greedy [batching=iteration]", "edgeshard"]
    assert by["hetroute"].batching_of(scenario) == Batching("iteration", 64)
    assert by["hetroute-unbatched"].batching_of(scenario) == Batching()
    assert by["greedy [batching=iteration]"].batching_of(scenario) == Batching("iteration", 8, 4)
    assert by["edgeshard"].batching_of(scenario) == Batching()  # pipelined: per request
    assert by["hetroute-unbatched"].to_json()["batching"]["mode"] == "none"
    assert "batching" not in by["hetroute"].to_json()


@pytest.mark.parametrize(("arm", "expected"), [
    ("{policy: hetroute, batching: continuous}",
     "batching.mode: must be one of none, iteration, got 'continuous'"),
    ("{policy: hetroute, batching: {mode: iteration, max_rows: 0}}",
     "batching.max_rows: must be an integer >= 1, got 0"),
    ("{policy: greedy, placement: edgeshard, dense: pipeline, batching: iteration}",
     "batching: iteration needs the dense part at home (dense: pipeline steps each request on "
     "its own, router.batching)"),
])
def test_a_bad_arm_batching_names_its_line(tmp_path: Path, arm: str, expected: str) -> None:
    path = tmp_path / "scen.yaml"
    path.write_text(TOPO + f"policies:\n  - greedy\n  - {arm}\n")
    with pytest.raises(InputError) as info:
        load_scenario(path)
    assert str(info.value) == f"{path}:{L + 3}: policies[1]: {expected}"


def test_the_routers_are_told_the_arms_batching(tmp_path: Path) -> None:
    from orchestrator.mesh.live import LiveMesh

    path = tmp_path / "scen.yaml"
    path.write_text(TOPO + "batching: {mode: iteration, max_rows: 64}\n")
    mesh = LiveMesh.__new__(LiveMesh)
    mesh.scenario, mesh.placement, mesh.router_settings = load_scenario(path), {}, {}
    mesh.endpoints = {n.name: _Endpoint() for n in mesh.scenario.topology.nodes}
    mesh.dense, mesh.batching = None, Batching()  # an arm's `batching: none`
    assert "batching" not in mesh.router_mesh()
    mesh.batching = Batching("iteration", 8)
    assert mesh.router_mesh()["batching"]["max_rows"] == 8
