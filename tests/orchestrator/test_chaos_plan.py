"""The chaos planner, invariants and leak probe, without a mesh: timelines from real placements
of the shipped scenarios, replayed instant by instant against an independent reachability
check."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.mesh.chaos import (
    ChaosSpec,
    Invariants,
    LeakProbe,
    cut_off,
    fp_holders,
    plan_chaos,
)
from orchestrator.mesh.faults import Fault
from orchestrator.placement import place, problem_from_scenario
from orchestrator.scenario.arms import load_scenario
from tests.helpers import ROOT

TINY_QUICK = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"


@pytest.fixture(scope="module")
def quickstart():
    scenario = load_scenario(TINY_QUICK)
    placement = place(problem_from_scenario(scenario), scenario.placement.policy).by_node()
    return scenario, placement


def replay(events: tuple[Fault, ...]) -> list[tuple[float, set[str], set[frozenset[str]]]]:
    """The nodes and links down after each event, in order (what the mesh goes through)."""
    nodes: set[str] = set()
    links: set[frozenset[str]] = set()
    states = []
    for e in events:
        if e.action == "node-down":
            nodes.add(e.target[0])
        elif e.action == "node-up":
            nodes.discard(e.target[0])
        elif e.action == "link-down":
            links.add(frozenset(e.target))
        elif e.action == "link-up" and not e.oneway:
            links.discard(frozenset(e.target))
        states.append((e.at_s, set(nodes), set(links)))
    return states


def reachable(placement, home: str, nodes: set[str], links: set[frozenset[str]]) -> bool:
    """Written apart from the planner's own check: every expert has an fp16 replica at home
    or on a live node linked to home."""
    experts: dict[tuple[int, int], list[str]] = {}
    for node, entries in placement.items():
        for e in entries:
            if e["variant"] == "fp16":
                experts.setdefault((e["layer"], e["expert"]), []).append(node)
    return all(any(n == home or (n not in nodes and frozenset((n, home)) not in links)
                   for n in holders) for holders in experts.values())


@pytest.mark.parametrize("seed", range(8))
def test_no_instant_cuts_an_expert_off(quickstart, seed: int) -> None:
    scenario, placement = quickstart
    homes = ("edge1", "edge2", "edge3")
    plan = plan_chaos(scenario.topology, placement, ChaosSpec(120.0, seed, homes))
    for at, nodes, links in replay(plan.events):
        assert not nodes & set(homes), f"a home was killed at {at}"
        for home in homes:
            assert reachable(placement, home, nodes, links), (seed, at, nodes, links)
    assert all(e.at_s < 120.0 for e in plan.events)
    final = replay(plan.events)[-1]
    assert final[1] == set() and final[2] == set(), "something is still down at the end"


def test_plans_are_seeded_and_varied(quickstart) -> None:
    scenario, placement = quickstart
    spec = ChaosSpec(120.0, 3, ("edge1", "edge2", "edge3"))
    a = plan_chaos(scenario.topology, placement, spec)
    assert a == plan_chaos(scenario.topology, placement, spec)
    b = plan_chaos(scenario.topology, placement, ChaosSpec(120.0, 4, spec.homes))
    assert a.faults != b.faults
    assert set(a.counts()) == {"link-down", "link-degrade", "node-down", "node-slow"}
    assert len(a.faults) >= 20


def test_one_fault_per_target_at_a_time(quickstart) -> None:
    scenario, placement = quickstart
    plan = plan_chaos(scenario.topology, placement, ChaosSpec(200.0, 1, ("edge1",)))
    spans: dict[object, list[tuple[float, float]]] = {}
    for f in plan.faults:
        key = frozenset(f.target) if f.is_link else f.target[0]
        spans.setdefault(key, []).append((f.at_s, f.at_s + f.for_s))
    for key, intervals in spans.items():
        intervals = sorted(set(intervals))  # a degrade is two one-way faults, one interval
        for (_, e0), (s1, _) in itertools.pairwise(intervals):
            assert s1 >= e0, (key, intervals)


def test_degrade_multiplies_each_directions_delay(quickstart) -> None:
    scenario, placement = quickstart
    plan = plan_chaos(scenario.topology, placement,
                      ChaosSpec(120.0, 0, ("edge1",), kinds=("link-degrade",)))
    assert plan.faults
    for f in plan.faults:
        base = scenario.topology.link(*f.target)
        assert f.oneway and f.change.delay_ms == pytest.approx(base.delay_ms * 5)
        assert f.change.loss_pct == 5.0


def test_a_single_replica_is_never_cut_off() -> None:
    """Expert (0, 0) lives only on n2 in full precision: n2 is never killed, its link to the
    home never cut; the planner refuses those candidates and says how many."""
    from orchestrator.scenario.topology import topology_from_data
    from orchestrator.scenario.yamlio import Loc

    topo = topology_from_data({"name": "t", "nodes": [{"name": n, "profile": "tiny-edge"}
                                                      for n in ("h", "n2", "n3")],
                               "defaults": {"class": "lan"}},
                              Loc("t.yaml"))
    placement = {"h": [], "n2": [{"layer": 0, "expert": 0, "variant": "fp16", "tier": "gpu"}],
                 "n3": [{"layer": 0, "expert": 0, "variant": "int4", "tier": "gpu"}]}
    plan = plan_chaos(topo, placement, ChaosSpec(300.0, 5, ("h",),
                                                 kinds=("node-down", "link-down")))
    assert plan.refused > 0
    for f in plan.faults:
        assert f.target not in (("n2",), ("h", "n2"))
    assert cut_off(fp_holders(placement), ["h"], frozenset({"n2"}), frozenset()) == ("h", (0, 0))
    assert cut_off(fp_holders(placement), ["h"], frozenset({"n3"}), frozenset()) is None


def test_bad_specs_name_the_field() -> None:
    with pytest.raises(ValueError, match="homes"):
        ChaosSpec(10.0, 0, ())
    with pytest.raises(ValueError, match="duration"):
        ChaosSpec(0.0, 0, ("a",))
    with pytest.raises(ValueError, match="kinds"):
        ChaosSpec(10.0, 0, ("a",), kinds=("meteor",))


def row(status="ok", reason="", quality=0.0, reroutes=0):
    return SimpleNamespace(policy="p", request=1, index=0, home="edge1", status=status,
                           reason=reason, quality=quality, reroutes=reroutes)


def test_invariants_allow_only_no_replica_failures_and_budgeted_tokens() -> None:
    inv = Invariants(budget=0.02)
    for r in (row(), row(reroutes=2), row("failed", "no_replica"),
              row("failed", "after:no_replica"), row("failed", "prompt:no_replica"),
              row(quality=0.02)):
        inv.check(r)
    assert inv.violations == []
    assert inv.tokens["p"] == 6 and inv.ok["p"] == 3 and inv.rerouted["p"] == 1
    for r in (row("failed", "deadline"), row("failed", "after:replans_exhausted"),
              row("failed", "request:unreachable:ClientConnectorError"),
              row(quality=0.0201)):
        inv.check(r)
    kinds = [v.kind for v in inv.violations]
    assert kinds == ["failure", "failure", "failure", "budget"]
    assert "deadline" in inv.violations[0].detail


def test_leak_probe_names_a_process_left_behind(tmp_path: Path) -> None:
    probe = LeakProbe(tmp_path)
    assert probe.left() == []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                              str(tmp_path)])
    try:
        left = probe.left()
        assert any(str(child.pid) in line for line in left), left
    finally:
        child.kill()
        child.wait()
    assert probe.left() == []


def test_leak_probe_knows_a_runtimes_own_names() -> None:
    """Only the run's own namespaces, devices and containers count, never the host's others."""
    probe = LeakProbe(Path("/nonexistent"))
    probe.own(SimpleNamespace(id="abc123"), {"edge1": SimpleNamespace(netns="mm-abc123-edge1")})
    assert probe.namespaces == {"mm-abc123-edge1"}
    assert probe.devices == {"mmbabc123", "mmvabc123"}
    ids = {"edge1": "0123456789abcdef"}
    probe.own(SimpleNamespace(container_id=ids.__getitem__), {"edge1": SimpleNamespace(netns=None)})
    assert probe.containers == {"0123456789ab"}
    assert probe.left() == []  # none of them exists on this host


def test_leak_probe_does_not_count_a_process_that_was_there_before(tmp_path: Path) -> None:
    """multiprocessing's resource tracker outlives every run of the process that started it."""
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        probe = LeakProbe(tmp_path)
        assert probe.left() == []
        later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            left = probe.left()
            assert len(left) == 1 and str(later.pid) in left[0], left
        finally:
            later.kill()
            later.wait()
    finally:
        earlier.kill()
        earlier.wait()
