"""How good a placement is, with the router's own cost model (`router.cost`, `router.tables`).

Two figures, both in scenario ms per calibration token (all MoE layers of one token):

- **expected cost** (`simulate`): the routing policy (HetRoute by default) plans every
  calibration token's layers against the placement, with the token's quality budget carried
  across layers; the cost is the mean of Σ_layers (predicted bottleneck latency) of those
  plans. Queues are empty and CPU-tier experts are never cached (a pessimistic offline view).
  It also counts how often each replica is chosen: HetRoute's offline stage uses that
  probability for GPU residency.
- **separable cost** (`separable_cost`): each expert a token asks for is served by its
  cheapest replica on its own, `T = tx(home→n) + load + compute + tx(n→home)` for one row
  plus the quality price of the replica's precision (`quality_ms x gate weight x penalty`),
  summed over the token's experts instead of the max over branches. It is linear in the
  placement's choices, so the ILP (`orchestrator.placement.ilp`) can optimise it exactly; the
  greedy policies' gap is measured on it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moe.vocab import TIERS
from router.cost import branch_cost
from router.errors import NoFeasiblePlan
from router.policies import make_policy
from router.tables import PlanView
from router.types import Placement, PlanRequest, Replica

from .problem import DEFAULT_ROUTER, PlacementProblem

__all__ = ["CostTables", "Simulation", "cost_tables", "separable_cost", "simulate"]


@dataclass(frozen=True)
class Simulation:
    """The router planned on calibration traffic (per-token means; see the module docstring)."""

    router: str
    expected_cost_ms: float
    objective_ms: float
    quality: float  # gate-weighted penalty spent per token (fraction)
    traffic_bytes: float  # bytes crossing the network per token (one row out, one back per
    # remote node a token-layer uses, however many of its experts run there: docs/cost-model.md)
    local_share: float  # expert executions on the token's home node
    failed: int  # token-layers without a feasible plan
    selections: Counter[Replica] = field(default_factory=Counter)  # picks per token


def simulate(problem: PlacementProblem, replicas: tuple[Replica, ...] | list[Replica],
             router: str = DEFAULT_ROUTER) -> Simulation:
    """Plan every calibration token with `router` against the placement (module docstring)."""
    placement = Placement.of(replicas)
    names = list(problem.names)
    views = {}
    for h in sorted(set(problem.homes.tolist())):
        view = PlanView(placement, problem.shape, problem.quality, names[h], nodes=names)
        view.refresh(problem.estimates)
        views[h] = view
    policy = make_policy(router, problem.settings, problem.seed)
    budget = problem.settings.budget
    row = problem.shape.row_bytes
    latency = objective = quality = traffic = 0.0
    local = total = failed = 0
    picks: Counter[Replica] = Counter()
    experts = problem.token_experts.tolist()
    weights = problem.token_weights.tolist()
    for t, h in enumerate(problem.homes.tolist()):
        view, home, left = views[h], names[h], budget
        for layer in range(problem.layers):
            req = PlanRequest(layer, tuple(experts[t][layer]), tuple(weights[t][layer]),
                              budget_left=max(left, 0.0))
            try:
                plan = policy.plan(view, req)
            except NoFeasiblePlan:
                failed += 1
                continue
            left -= plan.quality
            latency += plan.latency_ms
            objective += plan.objective
            quality += plan.quality
            for c in plan.choices:
                picks[c.replica] += 1
                total += 1
                local += c.replica.node == home
            traffic += 2 * row * len({c.replica.node for c in plan.choices} - {home})
    n = problem.tokens
    return Simulation(router, latency / n, objective / n, quality / n, traffic / n,
                      local / max(total, 1), failed,
                      Counter({r: c / n for r, c in picks.items()}))


@dataclass(frozen=True)
class CostTables:
    """per_use[h, n, v, t]: ms for one row of one expert from home h on node n in variant v and
    tier t (router.cost.branch_cost); price[l, e, v]: the quality price of variant v in ms;
    demand[h, l, e]: uses per token. Variant and tier axes follow `variants` and TIERS."""

    variants: tuple[str, ...]
    per_use: np.ndarray
    price: np.ndarray
    demand: np.ndarray

    def cost(self, layer: int, expert: int) -> np.ndarray:
        """[h, n, v, t]: what one use of this expert costs per replica choice."""
        return self.per_use + self.price[layer, expert][None, None, :, None]


def cost_tables(problem: PlacementProblem) -> CostTables:
    est, shape = problem.estimates, problem.shape
    names, variants = problem.names, problem.variants
    per_use = np.zeros((problem.nodes, problem.nodes, len(variants), len(TIERS)))
    for h, home in enumerate(names):
        for n, node in enumerate(names):
            for vi, v in enumerate(variants):
                for ti, tier in enumerate(TIERS):
                    item = (Replica(0, 0, node, v, tier), 1)
                    per_use[h, n, vi, ti] = branch_cost(est, shape, home, home, node,
                                                        [item]).total_ms
    gate = problem.mean_gate()
    q = problem.quality
    price = np.zeros((problem.layers, problem.experts, len(variants)))
    for layer in range(problem.layers):
        for e in range(problem.experts):
            for vi, v in enumerate(variants):
                price[layer, e, vi] = (problem.settings.quality_ms * gate[layer, e]
                                       * q.quant_penalty(layer, e, v))
    return CostTables(tuple(variants), per_use, price, problem.demand())


def separable_cost(problem: PlacementProblem, replicas: tuple[Replica, ...] | list[Replica],
                   tables: CostTables | None = None) -> float:
    """Σ over homes, layers, experts of demand x the cheapest replica's cost (ms per token);
    inf when a used expert has no replica."""
    tables = tables or cost_tables(problem)
    index = {name: i for i, name in enumerate(problem.names)}
    vindex = {v: i for i, v in enumerate(tables.variants)}
    by_expert: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r in replicas:
        by_expert.setdefault((r.layer, r.expert), []).append(
            (index[r.node], vindex[r.variant], TIERS.index(r.tier)))
    total = 0.0
    for layer in range(problem.layers):
        for e in range(problem.experts):
            d = tables.demand[:, layer, e]
            if not d.any():
                continue
            held = by_expert.get((layer, e))
            if not held:
                return float("inf")
            cost = tables.cost(layer, e)
            best = np.min(np.stack([cost[:, n, v, t] for n, v, t in held]), axis=0)
            total += float(d @ best)
    return total
