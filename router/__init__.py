"""The router: for each token and MoE layer, which replica on which node serves each expert.

Offers the cost model of docs/cost-model.md (`Estimates`, `branch_cost`, `layer_cost`; plain data in
`router.types`), online estimators, the routing policies (`make_policy`, `POLICIES`:
local-first, random, greedy, hetroute, ordermoe, hetroute+ordermoe, exact), the dispatcher
and the home node's inference engine with its iteration-level batching (`Batching`, the
scenario's and PUT /v1/mesh's `batching`), and `attach(node)`, which mounts `/v1/generate`,
`/v1/score`, `PUT /v1/mesh` and `GET /v1/router` on a `services.Node`.
"""

from __future__ import annotations

from typing import Any

from .batching import Batching
from .cost import Breakdown, Estimates, LayerCost, branch_cost, layer_cost
from .errors import BadRouterInput, NoFeasiblePlan, RouterError, TokenFailed
from .estimators import Estimators
from .mesh import Mesh
from .policies import POLICIES, Policy, make_policy
from .quality import QualityTable
from .settings import Settings
from .tables import PlanView
from .types import (
    Choice,
    LinkEstimate,
    ModelShape,
    NodeEstimate,
    Placement,
    Plan,
    PlanRequest,
    Replica,
    Scales,
)

__all__ = [
    "POLICIES",
    "BadRouterInput",
    "Batching",
    "Breakdown",
    "Choice",
    "Estimates",
    "Estimators",
    "LayerCost",
    "LinkEstimate",
    "Mesh",
    "ModelShape",
    "NoFeasiblePlan",
    "NodeEstimate",
    "Placement",
    "Plan",
    "PlanRequest",
    "PlanView",
    "Policy",
    "QualityTable",
    "Replica",
    "RouterError",
    "Scales",
    "Settings",
    "TokenFailed",
    "attach",
    "branch_cost",
    "layer_cost",
    "make_policy",
]


def attach(node: Any, quality: Any = None, settings: Any = None) -> Any:
    """Mount the router on a `services.Node` (lazy import: aiohttp and torch load on use)."""
    from .app import attach as _attach

    return _attach(node, quality, settings)
