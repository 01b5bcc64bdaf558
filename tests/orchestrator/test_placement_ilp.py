"""The exact ILP: it agrees with brute force on tiny instances and bounds every greedy policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moe.vocab import TIERS
from netem.spec import LinkSpec
from orchestrator.placement import POLICIES, PlacementError, PlacementProblem, check, place
from orchestrator.placement import ilp as ilp_mod
from orchestrator.placement.evaluate import cost_tables, separable_cost
from orchestrator.placement.problem import estimates_from_topology
from orchestrator.scenario.topology import Node, Topology
from router.quality import QualityTable
from router.types import ModelShape, Replica
from services.device import DeviceProfile

B = 1000
SIZES = {"fp16": B, "int8": 540, "int4": 290}


def tiny(gpu: list[float], cpu: list[float], *, experts: int = 2, variants: tuple[str, ...],
         redundancy: float, delays: list[float], seed: int = 0) -> PlacementProblem:
    """One layer, `experts` experts, top-1; memory in units of one fp16 expert."""
    nodes = [Node(f"n{i}", DeviceProfile("d", gpu_tflops=0.01 * (i + 1),
                                         gpu_mem_gb=g * B / 1e9, cpu_mem_gb=c * B / 1e9,
                                         h2d_gbps=0.001), users=1.0 + i)
             for i, (g, c) in enumerate(zip(gpu, cpu, strict=True))]
    pairs = list(itertools.combinations(range(len(nodes)), 2))
    topo = Topology.build(nodes, symmetric={
        (nodes[a].name, nodes[b].name): LinkSpec(delay_ms=d, rate_mbit=100.0)
        for (a, b), d in zip(pairs, delays, strict=True)})
    rng = np.random.default_rng(seed)
    tokens = 40
    homes = rng.choice(len(nodes), size=tokens, p=list(topo.user_shares().values()))
    popularity = np.linspace(2, 1, experts)
    picks = rng.choice(experts, size=(tokens, 1, 1), p=popularity / popularity.sum())
    quality = QualityTable.synthetic(1, experts, seed)
    return PlacementProblem(
        names=topo.names, gpu_bytes=tuple(n.device.gpu_bytes for n in nodes),
        cpu_bytes=tuple(n.device.cpu_bytes for n in nodes), layers=1, experts=experts,
        top_k=1, expert_bytes=SIZES,
        shape=ModelShape(d_model=64, expert_flops=2e5, expert_bytes=SIZES),
        estimates=estimates_from_topology(topo), quality=quality,
        home_shares=tuple(topo.user_shares().values()), homes=homes, token_experts=picks,
        token_weights=np.ones((tokens, 1, 1)), redundancy=redundancy, variants=variants,
        seed=seed)


def brute_force(problem: PlacementProblem) -> tuple[float, tuple[Replica, ...]]:
    """Every placement (each node, expert and variant: absent, GPU or CPU), the cheapest valid."""
    slots = [(n, e, v) for n in problem.names for e in range(problem.experts)
             for v in problem.variants]
    tables = cost_tables(problem)
    best = (float("inf"), ())
    for choice in itertools.product((None, *TIERS), repeat=len(slots)):
        reps = tuple(Replica(0, e, n, v, t) for (n, e, v), t in zip(slots, choice, strict=True)
                     if t is not None)
        try:
            check(problem, reps)
        except PlacementError:
            continue
        cost = separable_cost(problem, reps, tables)
        if cost < best[0] - 1e-12:
            best = (cost, reps)
    return best


@pytest.mark.parametrize("case", [
    # two nodes, fp16 and int4: GPU room for one fp16 (or a few int4) each, little CPU
    dict(gpu=[1.3, 1.9], cpu=[0.5, 1.2], variants=("fp16", "int4"), redundancy=2.0,
         delays=[6.0]),
    # three nodes, fp16 only, a tight budget: where the two copies go decides it
    dict(gpu=[1.2, 2.2, 0.4], cpu=[3.0, 0.6, 2.5], variants=("fp16",), redundancy=1.5,
         delays=[2.0, 9.0, 4.0]),
])
def test_ilp_agrees_with_brute_force(case: dict) -> None:
    problem = tiny(**case)
    best, reps = brute_force(problem)
    assert np.isfinite(best) and reps
    result = ilp_mod.solve(problem, time_limit_s=60)
    assert result.optimal
    check(problem, result.replicas)
    assert result.objective_ms == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert separable_cost(problem, result.replicas) == pytest.approx(best, rel=1e-6, abs=1e-9)


def test_ilp_bounds_every_greedy_policy() -> None:
    problem = tiny(gpu=[2.5, 3.2, 1.5], cpu=[4.0, 2.0, 6.0], experts=4,
                   variants=("fp16", "int8", "int4"), redundancy=2.0, delays=[3.0, 8.0, 5.0])
    result = ilp_mod.solve(problem, time_limit_s=60)
    assert result.optimal
    for policy in POLICIES:
        greedy = place(problem, policy)
        assert greedy.separable_cost_ms >= result.objective_ms - 1e-9, policy
        assert ilp_mod.gap(greedy.separable_cost_ms, result) >= -1e-9


def test_ilp_refuses_large_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = tiny(gpu=[2.0, 2.0], cpu=[2.0, 2.0], variants=("fp16",), redundancy=1.0,
                   delays=[1.0])
    monkeypatch.setattr(ilp_mod, "MAX_VARIABLES", 10)
    with pytest.raises(PlacementError, match=r"variables \(limit 10\): use it on small"):
        ilp_mod.solve(problem)
