"""Offline placement: which node holds which experts, in which precision and memory tier.

Offers the policies (one module each: `hetroute`, `ordermoe`, `prism`, `popularity`, `random`,
`layer-shard`, `edgeshard`), all keeping every node's memory and at least one full-precision
replica of every expert; `place(problem, policy)` runs one, checks it and measures it with the
router's cost model and by its local group coverage (`coverage`); `problem_from_scenario`
builds the problem of a scenario; `ilp.solve` is the exact ILP of the separable objective for
small instances (the greedy's optimality gap).

    problem = problem_from_scenario(load_scenario("experiments/scenarios/quickstart.yaml"))
    result = place(problem, "hetroute")
    result.by_node()   # node → its PUT /v1/placement experts
"""

from __future__ import annotations

import random
from dataclasses import replace

from .base import Ledger, PlacementResult, Policy, check
from .coverage import local_group_coverage
from .edgeshard import EdgeShardPlacement
from .evaluate import Simulation, separable_cost, simulate
from .hetroute import HetRoutePlacement
from .layer_shard import LayerShardPlacement
from .ordermoe import OrderMoEPlacement
from .popularity import PopularityPlacement
from .prism import PrismPlacement, PrismQuantPlacement
from .problem import (
    DEFAULT_ROUTER,
    EACH_ARM,
    PlacementError,
    PlacementProblem,
    problem_from_scenario,
)
from .random_policy import RandomPlacement

__all__ = [
    "DEFAULT_ROUTER",
    "EACH_ARM",
    "POLICIES",
    "Ledger",
    "PlacementError",
    "PlacementProblem",
    "PlacementResult",
    "Policy",
    "Simulation",
    "check",
    "local_group_coverage",
    "make_policy",
    "place",
    "problem_from_scenario",
    "separable_cost",
    "simulate",
]

_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (HetRoutePlacement, OrderMoEPlacement, PrismPlacement, PrismQuantPlacement,
                PopularityPlacement,
                RandomPlacement, LayerShardPlacement, EdgeShardPlacement)
}
POLICIES = tuple(_CLASSES)


def make_policy(name: str) -> Policy:
    try:
        return _CLASSES[name]()
    except KeyError:
        raise PlacementError(f"unknown placement policy {name!r}; known: "
                             f"{', '.join(POLICIES)}") from None


def place(problem: PlacementProblem, policy: str, *, router: str | None = None
          ) -> PlacementResult:
    """Run one policy (seeded by the problem's seed), check the rules, measure the result.
    `router`: the routing policy the placement is built for and measured with (None: the
    problem's, the scenario's `placement.router`)."""
    if router is not None and router != problem.router:
        problem = replace(problem, router=router)
    router = problem.router
    chosen = make_policy(policy)
    ledger = chosen.place(problem, random.Random(problem.seed))
    replicas = ledger.replicas()
    check(problem, replicas)
    sim = simulate(problem, replicas, router)
    notes = {**chosen.notes(problem, ledger), "router": router,
             "local_group_coverage": local_group_coverage(problem, replicas),
             "objective_ms": sim.objective_ms, "quality_per_token": sim.quality,
             "traffic_bytes_per_token": sim.traffic_bytes, "local_share": sim.local_share,
             "failed_token_layers": sim.failed}
    return PlacementResult(policy, problem, replicas, sim.expected_cost_ms,
                           separable_cost(problem, replicas), notes)
