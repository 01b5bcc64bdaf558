"""The partitioner (orchestrator.partitioner): the longest lookahead a grouping can have, a
zero-delay link never cut, an even load where the delays allow it, and the same answer for the
same input."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from netem.schedule import Schedule
from netem.spec import LinkSpec
from orchestrator.partitioner import (
    frontier,
    min_delay_ms,
    pair_delays_ms,
    partition,
    scenario_load,
)
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.topology import Node, Topology, load_topology
from services.device import builtin_profiles
from tests.helpers import ROOT

DEVICE = builtin_profiles()["tiny-edge"]


def mesh(names: list[str], delay: dict[frozenset[str], float] | None = None,
         default_ms: float = 5.0, oneway: dict[tuple[str, str], LinkSpec] | None = None
         ) -> Topology:
    """A full mesh of `names`: `delay[{a, b}]` ms both ways, else `default_ms`."""
    symmetric = {tuple(sorted(pair)): LinkSpec(delay_ms=ms) for pair, ms in (delay or {}).items()}
    return Topology.build([Node(n, DEVICE) for n in names], default=LinkSpec(delay_ms=default_ms),
                          symmetric=symmetric, oneway=oneway)


def clusters(sizes: tuple[int, ...], inside_ms: float = 1.0, across_ms: float = 20.0
             ) -> Topology:
    names = [f"{chr(ord('a') + c)}{i}" for c, size in enumerate(sizes) for i in range(size)]
    inside = {frozenset(p): inside_ms for p in itertools.combinations(names, 2)
              if p[0][0] == p[1][0]}
    return mesh(names, inside, default_ms=across_ms)


def brute_force_lookahead(topo: Topology, k: int) -> float:
    """The best lookahead over every grouping into exactly k non-empty groups."""
    names = sorted(topo.names)
    delays = pair_delays_ms(topo)
    best = 0.0
    for labels in itertools.product(range(k), repeat=len(names)):
        if len(set(labels)) != k:
            continue
        where = dict(zip(names, labels, strict=True))
        look = min(w for (a, b), w in delays.items() if where[a] != where[b])
        best = max(best, look)
    return best


def test_two_clusters_far_apart_split_between_them() -> None:
    p = partition(clusters((3, 3)), 2)
    assert p.groups == (("a0", "a1", "a2"), ("b0", "b1", "b2"))
    assert p.lookahead_ms == 20.0
    assert p.shares == (0.5, 0.5) and p.balance == 1.0


def test_three_clusters_in_three_partitions_and_two() -> None:
    topo = clusters((2, 2, 2), inside_ms=0.5, across_ms=8.0)
    three = partition(topo, 3)
    assert three.groups == (("a0", "a1"), ("b0", "b1"), ("c0", "c1"))
    assert three.lookahead_ms == 8.0
    # two partitions of three clusters: whole clusters (4 + 2 nodes) keep 8 ms but a balance of
    # 1.33; the default tolerance (1.25) prefers 3 + 3 at the clusters' inner delay
    two = partition(topo, 2)
    assert [len(g) for g in two.groups] == [3, 3] and two.lookahead_ms == 0.5
    loose = partition(topo, 2, max_imbalance=1.5)
    assert loose.lookahead_ms == 8.0 and loose.balance == pytest.approx(4 / 3)


def test_the_lookahead_is_the_best_any_grouping_reaches() -> None:
    rng = random.Random(5)
    names = [f"n{i}" for i in range(7)]
    for _ in range(6):
        delay = {frozenset(p): float(rng.randint(1, 30)) for p in itertools.combinations(names, 2)}
        topo = mesh(names, delay)
        for k in (2, 3, 4):
            p = partition(topo, k, max_imbalance=math.inf)
            assert len(p.groups) == k
            assert p.lookahead_ms == brute_force_lookahead(topo, k)


def test_a_zero_delay_link_is_never_cut() -> None:
    topo = mesh(["a", "b", "c", "d"], {frozenset({"a", "b"}): 0.0})
    for k in (2, 3, 4, 8):
        p = partition(topo, k)
        assert ("a", "b") in [g[:2] for g in p.groups if "a" in g]
        assert p.group_of("a") == p.group_of("b")
        assert p.lookahead_ms == 5.0
    assert len(partition(topo, 4).groups) == 3  # a and b are one atom: three groups at most
    # even a heavy pair stays whole: the balance gives way, not the link
    heavy = partition(topo, 2, load={"a": 10, "b": 10, "c": 1, "d": 1})
    assert heavy.groups == (("a", "b"), ("c", "d")) and heavy.shares == (20 / 22, 2 / 22)


def test_one_way_zero_delay_and_a_jitter_reaching_zero_keep_the_ends_together() -> None:
    oneway = {("c", "a"): LinkSpec(delay_ms=0.0)}  # a→c is 5 ms, c→a is 0: still zero-lookahead
    topo = mesh(["a", "b", "c", "d"], oneway=oneway)
    assert pair_delays_ms(topo)[("a", "c")] == 0.0
    assert partition(topo, 4).group_of("a") == partition(topo, 4).group_of("c")
    jitter = {("b", "d"): LinkSpec(delay_ms=3.0, jitter_ms=3.0)}
    p = partition(mesh(["a", "b", "c", "d"], oneway=jitter), 4)
    assert p.group_of("b") == p.group_of("d") and p.lookahead_ms == 5.0


def test_a_link_floor_counts_its_jitter_and_schedule() -> None:
    assert min_delay_ms(LinkSpec(delay_ms=4.0)) == 4.0
    assert min_delay_ms(LinkSpec(delay_ms=4.0, jitter_ms=1.0)) == 3.0
    normal = min_delay_ms(LinkSpec(delay_ms=4.0, jitter_ms=1.0, jitter_dist="normal"))
    assert 0.0 <= normal < 3.0  # a normal table reaches beyond one sigma
    steps = Schedule(((0.0, 4.0, None, None), (10.0, 1.5, None, None)))
    assert min_delay_ms(LinkSpec(delay_ms=4.0, schedule=steps)) == 1.5


def test_equal_delays_balance_the_nodes() -> None:
    topo = mesh([f"n{i}" for i in range(8)])
    for k in (2, 4, 8):
        p = partition(topo, k)
        assert len(p.groups) == k and {len(g) for g in p.groups} == {8 // k}
        assert p.balance == 1.0 and p.lookahead_ms == 5.0


def test_uneven_loads_are_balanced_by_weight() -> None:
    topo = mesh(["a", "b", "c", "d", "e"])
    p = partition(topo, 2, load={"a": 4, "b": 1, "c": 1, "d": 1, "e": 1})
    assert p.groups == (("a",), ("b", "c", "d", "e")) and p.balance == 1.0
    # one node with 60% of the work: the best balance there is (1.2) is what is asked
    p = partition(topo, 2, load={"a": 6, "b": 1, "c": 1, "d": 1, "e": 1})
    assert p.shares == (0.6, 0.4) and p.balance == pytest.approx(1.2)


def test_the_greedy_packing_balances_a_large_mesh() -> None:
    names = [f"n{i:02d}" for i in range(30)]
    rng = random.Random(2)
    load = {n: rng.uniform(1, 3) for n in names}
    p = partition(mesh(names), 4, load=load)
    assert len(p.groups) == 4 and sorted(n for g in p.groups for n in g) == names
    assert p.balance < 1.02


def test_same_input_same_output_whatever_the_order() -> None:
    topo = load_topology(ROOT / "experiments" / "scenarios" / "topologies" / "paper10.yaml")
    again = Topology(tuple(reversed(topo.nodes)), tuple(reversed(topo.links)), name=topo.name)
    for k in (2, 3, 4, 8):
        first = partition(topo, k)
        assert partition(topo, k) == first == partition(again, k)
        assert list(first.groups) == sorted(first.groups)
        assert all(list(g) == sorted(g) for g in first.groups)


def test_k1_is_one_group_and_k_past_the_nodes_is_one_node_each() -> None:
    topo = clusters((2, 2))
    one = partition(topo, 1)
    assert one.groups == (("a0", "a1", "b0", "b1"),) and math.isinf(one.lookahead_ms)
    assert one.shares == (1.0,) and one.balance == 1.0
    assert one.to_json()["lookahead_ms"] is None
    many = partition(topo, 9)
    assert many.groups == (("a0",), ("a1",), ("b0",), ("b1",)) and many.k == 9
    assert many.lookahead_ms == 1.0
    single = partition(mesh(["solo"]), 4)
    assert single.groups == (("solo",),) and math.isinf(single.lookahead_ms)


def test_the_frontier_trades_lookahead_for_balance() -> None:
    options = frontier(clusters((4, 2)), 2)
    looks = [p.lookahead_ms for p in options]
    assert looks == sorted(looks, reverse=True) and looks[0] == 20.0
    assert options[0].balance == pytest.approx(4 / 3) and options[-1].balance == 1.0


@pytest.mark.parametrize("k", [0, -1, 2.0, "2", True, None])
def test_a_bad_k_says_what_k_must_be(k: object) -> None:
    with pytest.raises(ValueError, match=r"k: the number of partitions must be an integer >= 1"):
        partition(clusters((2, 2)), k)  # type: ignore[arg-type]


@pytest.mark.parametrize(("load", "match"), [
    ({"a0": 1, "a1": 1, "b0": 1}, "no value for node 'b1'"),
    ({"a0": 1, "a1": 1, "b0": 1, "b1": 1, "zz": 1}, "unknown node 'zz'"),
    ({"a0": -1, "a1": 1, "b0": 1, "b1": 1}, "a0 must be a finite number >= 0"),
    ({"a0": 0, "a1": 0, "b0": 0, "b1": 0}, "sum to 0"),
])
def test_a_bad_load_names_the_node(load: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(clusters((2, 2)), 2, load=load)


def test_a_bad_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match="max_imbalance: must be a number >= 1"):
        partition(clusters((2, 2)), 2, max_imbalance=0.5)


def test_the_load_of_a_scenario_follows_its_placement_and_homes() -> None:
    scenario = load_scenario(ROOT / "experiments" / "scenarios" / "tiny-quick.yaml")
    load = scenario_load(scenario)
    assert set(load) == set(scenario.topology.names) and all(v >= 0 for v in load.values())
    # edge1 homes 40% of the users (edge5.yaml): it carries the most work
    assert max(load, key=load.__getitem__) == "edge1"
    p = partition(scenario.topology, 2, load=load)
    assert sum(p.shares) == pytest.approx(1.0) and len(p.groups) == 2
