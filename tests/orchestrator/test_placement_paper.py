"""The papers' placements on the shipped paper scenarios: OrderMoE's local group coverage and
GPU tier first, its expected cost against random deployment and popularity replication, and
Prism against layer sharding (docs/papers.md has the figures and why)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from netem.spec import LinkSpec
from orchestrator.placement import PlacementResult, make_policy, place, problem_from_scenario
from orchestrator.placement.base import Ledger
from orchestrator.placement.coverage import local_group_coverage
from orchestrator.placement.ilp import max_coverage
from orchestrator.placement.prism import plan_migration, remote_share
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.topology import Node, Topology
from router.quality import QualityTable
from router.types import Replica
from services.device import DeviceProfile
from tests.helpers import ROOT
from tests.orchestrator.test_placement import B16, make_problem

SCENARIOS = ROOT / "experiments" / "scenarios"
TINY = ("hetroute-paper", "ordermoe-paper")  # tiny-moe, ten servers, redundancy 2.0
POLICIES = ("ordermoe", "random", "popularity", "prism", "layer-shard")


@pytest.fixture(scope="module")
def paper() -> dict[str, dict[str, PlacementResult]]:
    """Each paper scenario's placements, at the CLI's default calibration."""
    out: dict[str, dict[str, PlacementResult]] = {}
    for name in (*TINY, "hetroute-paper-mixtral"):
        scenario = load_scenario(SCENARIOS / f"{name}.yaml")
        problem = problem_from_scenario(scenario)
        out[name] = {p: place(problem, p) for p in POLICIES}
    return out


def exact_bound(problem) -> float:
    """The most coverage exact replicas alone could give: one fp16 copy of every expert and
    the rest of the budget in the smallest variant, each on the (home, expert) pair used most
    (per-node memory ignored, so an upper bound)."""
    d = problem.demand().reshape(-1)
    whole = problem.layers * problem.experts
    small = min(problem.bytes_of(v) for v in problem.variants)
    pairs = whole + (problem.budget_bytes - whole * problem.bytes_of("fp16")) // small
    return float(np.sort(d)[::-1][:pairs].sum() / d.sum())


def assert_gpu_first(problem, replicas) -> None:
    """No replica in a CPU tier while some node's GPU tier (keeping the room a CPU-tier
    expert needs there) could still take it."""
    ledger = Ledger.of(problem, replicas)
    for r in replicas:
        if r.tier == "cpu":
            room = max(ledger.gpu_room(n) for n in range(problem.nodes))
            assert room < problem.bytes_of(r.variant), (r, room)


@pytest.mark.parametrize("name", TINY)
def test_ordermoe_covers_what_the_budget_allows_gpu_first(name, paper) -> None:
    result = paper[name]["ordermoe"]
    coverage = result.notes["local_group_coverage"]
    # tiny-moe's flat popularity and few admissible substitutes cap it below the paper's 88%
    # at redundancy 2.0 (docs/papers.md): reach what exact replicas alone could at most
    assert coverage >= exact_bound(result.problem)
    assert coverage > max(paper[name][p].notes["local_group_coverage"] for p in POLICIES[1:])
    assert not [r for r in result.replicas if r.tier == "cpu"]  # the GPUs hold the budget


def test_ordermoe_reaches_85_percent_where_the_budget_allows() -> None:
    scenario = load_scenario(SCENARIOS / "ordermoe-paper.yaml")
    scenario = replace(scenario, placement=replace(scenario.placement, redundancy=2.5))
    problem = problem_from_scenario(scenario, tokens=1024)
    assert exact_bound(problem) > 0.85
    assert place(problem, "ordermoe").notes["local_group_coverage"] >= 0.85


@pytest.mark.parametrize("name", TINY)
def test_ordermoe_costs_less_than_random_and_popularity(name, paper) -> None:
    cost = {p: r.expected_cost_ms for p, r in paper[name].items()}
    assert cost["ordermoe"] < cost["random"]
    assert cost["ordermoe"] < cost["popularity"]


@pytest.mark.parametrize("name", [*TINY, "hetroute-paper-mixtral"])
def test_prism_against_layer_shard(name, paper) -> None:
    """Prism's own objective (remote invocations) is always lower than layer sharding's; its
    expected cost is at most layer sharding's on Mixtral. On tiny-moe it is within 5%: the
    layer waits for its slowest branch, and sharding keeps a token's whole layer on one node
    (0.86 remote nodes per token-layer against Prism's 1.24, docs/papers.md)."""
    prism, shard = paper[name]["prism"], paper[name]["layer-shard"]
    demand = prism.problem.demand()

    def remote(result: PlacementResult) -> float:
        names = result.problem.names
        return remote_share(demand, [{(r.layer, r.expert) for r in result.replicas
                                      if r.node == n} for n in names])

    assert remote(prism) < remote(shard)
    limit = 1.0 if name == "hetroute-paper-mixtral" else 1.05
    assert prism.expected_cost_ms <= limit * shard.expected_cost_ms
    assert not [r for r in prism.replicas if r.tier == "cpu"]


@pytest.mark.parametrize("policy", ["ordermoe", "prism"])
def test_gpu_tier_first_when_memory_is_tight(policy) -> None:
    """Small GPUs, large CPUs: CPU-tier replicas only once no GPU tier has room."""
    nodes = [Node(f"n{i}", DeviceProfile("d", 1, (3 + i) * B16 / 1e9 + 1e-9,
                                         20 * B16 / 1e9, 1), users)
             for i, users in enumerate((3.0, 1.0, 1.0))]
    problem = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=3)), layers=2,
                           experts=8, top_k=2, redundancy=2.0, tokens=96)
    replicas = make_policy(policy).place(problem, random.Random(0)).replicas()
    assert [r for r in replicas if r.tier == "cpu"]  # the case needs the CPU tier
    assert_gpu_first(problem, replicas)


def test_coverage_counts_substitutes_within_the_budget() -> None:
    """Two nodes, one layer, experts 0 and 1 similar (substitution penalty 1%), expert 2 not;
    every token homed at a and asking for 0 (weight 0.6) and 2 (0.4)."""
    nodes = [Node(n, DeviceProfile("d", 1, 10 * B16 / 1e9, 10 * B16 / 1e9, 1), u)
             for n, u in (("a", 1.0), ("b", 0.0))]
    p = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=1)), layers=1,
                     experts=3, top_k=2, tokens=4)
    sim = np.eye(3)[None].copy()
    sim[0, 0, 1] = sim[0, 1, 0] = 0.95
    subst = np.full((1, 3, 3), np.inf)
    subst[0, 0, 1] = subst[0, 1, 0] = 0.01
    quant = np.zeros((1, 3, 3))
    quant[0, :, 2] = 0.04  # int4 costs 4% per use: never within a 2% budget
    q = QualityTable(quant, subst, sim, np.array([0.9]), p.quality.transition)
    p = replace(p, quality=q, homes=np.zeros(4, dtype=int),
                token_experts=np.tile(np.array([[[0, 2]]]), (4, 1, 1)),
                token_weights=np.tile(np.array([[[0.6, 0.4]]]), (4, 1, 1)))

    def cov(*held: tuple[str, int, str]) -> float:
        return local_group_coverage(p, [Replica(0, e, n, v, "gpu") for n, e, v in held])

    assert cov(("b", 0, "fp16"), ("b", 2, "fp16")) == 0.0  # nothing at home
    assert cov(("a", 0, "fp16")) == 0.5
    assert cov(("a", 1, "fp16")) == 0.5  # 0.6 x 1% = 0.6% fits the 2% budget (one layer)
    assert cov(("a", 1, "int8"), ("a", 2, "int4")) == 1.0  # int4 for 2: 0.4 x 4% = 1.6%
    assert cov(("a", 1, "int4")) == 0.0  # 0.6 x (4% + 1%) = 3% does not


def test_prism_migration_moves_only_when_it_pays() -> None:
    nodes = [Node(f"n{i}", DeviceProfile("d", 1, 8 * B16 / 1e9 + 1e-9, 8 * B16 / 1e9, 1), 1.0)
             for i in range(3)]
    p = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=3)), layers=2,
                     experts=6, top_k=2, tokens=96)
    current = place(p, "prism").replicas
    same = plan_migration(p, current, p.demand(), tokens_per_s=100, horizon_s=60,
                          remote_ms=10, copy_ms_per_expert=50)
    assert not same.add and not same.drop and not same.worth  # the traffic has not moved
    shifted = p.demand()[:, :, ::-1].copy()  # the experts' popularity turns around
    move = plan_migration(p, current, shifted, tokens_per_s=100, horizon_s=60,
                          remote_ms=10, copy_ms_per_expert=50)
    assert move.add and move.remote_after < move.remote_before and move.worth
    costly = plan_migration(p, current, shifted, tokens_per_s=100, horizon_s=60,
                            remote_ms=10, copy_ms_per_expert=1e9)
    assert costly.add == move.add and not costly.worth


def test_max_coverage_is_the_best_placement_by_enumeration() -> None:
    """Two nodes, one layer, three experts in fp16 or int4 (12 replicas, 4,096 placements):
    the coverage program's optimum is the best coverage of any placement that keeps an fp16
    copy of every expert, each node's memory (GPU and CPU pooled: coverage ignores tiers) and
    the redundancy budget."""
    nodes = [Node(n, DeviceProfile("d", 1, g * B16 / 1e9, 0.5 * B16 / 1e9, 1), u)
             for n, g, u in (("a", 1.0, 3.0), ("b", 2.0, 1.0))]
    p = make_problem(Topology.build(nodes, default=LinkSpec(delay_ms=1)), layers=1,
                     experts=3, top_k=2, tokens=24, redundancy=1.3, variants=("fp16", "int4"))
    options = [(n, e, v) for n in p.names for e in range(3) for v in p.variants]
    best = 0.0
    for mask in range(1 << len(options)):
        held = [o for i, o in enumerate(options) if mask >> i & 1]
        weigh = [sum(p.bytes_of(v) for m, _, v in held if m == n) for n in p.names]
        if (sum(weigh) > p.budget_bytes
                or any(w > g + c for w, g, c in zip(weigh, p.gpu_bytes, p.cpu_bytes, strict=True))
                or {e for _, e, v in held if v == "fp16"} != {0, 1, 2}):
            continue
        best = max(best, local_group_coverage(p, [Replica(0, e, n, v, "gpu")
                                                  for n, e, v in held]))
    found = max_coverage(p)
    assert found.optimal and 0 < best < 1
    assert found.coverage == pytest.approx(best, abs=1e-9)
    assert max_coverage(p, within_budget=False).coverage >= found.coverage


@pytest.mark.parametrize("name", TINY)
def test_85_percent_coverage_is_out_of_reach_at_redundancy_2(name, paper) -> None:
    """No placement of tiny-moe's 64 experts within memory ratio 2.0 covers 85% of the uses,
    even with the budget aside (every substitute and int4 copy counted): the issue's target
    cannot be met on these scenarios (docs/papers.md). OrderMoE's placement comes within 2% of
    the optimum."""
    result = paper[name]["ordermoe"]
    best = max_coverage(result.problem)
    assert best.optimal and best.coverage < 0.85
    assert max_coverage(result.problem, within_budget=False).coverage < 0.85
    assert result.notes["local_group_coverage"] >= 0.98 * best.coverage


def test_prism_quant_spends_prism_memory_on_int4_copies_and_prism_stays_fp16() -> None:
    """Issue 39 item 3: Prism with quantized replication. `prism-quant` keeps one fp16 copy of
    every expert and makes its other copies in the smallest allowed precision, so the same
    budget holds more copies and fewer activations leave their home; `prism` (as published)
    stays fp16 only, whatever the scenario's variants."""
    scenario = load_scenario(SCENARIOS / "hetroute-paper.yaml")
    problem = replace(problem_from_scenario(scenario), variants=("fp16", "int4"))
    prism, quant = place(problem, "prism"), place(problem, "prism-quant")
    assert {r.variant for r in prism.replicas} == {"fp16"}
    assert {r.variant for r in quant.replicas} == {"fp16", "int4"}
    fp16 = {(r.layer, r.expert) for r in quant.replicas if r.variant == "fp16"}
    assert len(fp16) == problem.layers * problem.experts  # every expert at full precision
    used = sum(problem.bytes_of(r.variant) for r in quant.replicas)
    assert used <= problem.budget_bytes
    assert len(quant.replicas) > 1.5 * len(prism.replicas)
    demand = problem.demand()

    def remote(result: PlacementResult) -> float:
        return remote_share(demand, [{(r.layer, r.expert) for r in result.replicas
                                      if r.node == n} for n in problem.names])

    assert remote(quant) < remote(prism)
