"""Routing policies, one module each behind one interface (`Policy.plan`).

`make_policy(name, settings, seed)` builds one by name; `POLICIES` lists the names.
"""

from __future__ import annotations

from ..errors import BadRouterInput
from ..settings import Settings
from .base import Policy
from .exact import Exact
from .greedy import Greedy
from .hetroute import HetRoute
from .hetroute_ordermoe import HetRouteOrderMoE
from .local_first import LocalFirst
from .ordermoe import OrderMoE
from .random_policy import RandomPolicy

__all__ = ["MESH_POLICIES", "POLICIES", "Policy", "make_policy"]

_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (LocalFirst, RandomPolicy, Greedy, HetRoute, OrderMoE, HetRouteOrderMoE, Exact)
}
POLICIES = tuple(_CLASSES)
# What a scenario's plain `policies:` list may name: all but `exact`, which serves the home
# node's own model with no network and is only ever an arm (orchestrator/arms.py).
MESH_POLICIES = tuple(name for name, cls in _CLASSES.items() if cls is not Exact)


def make_policy(name: str, settings: Settings | None = None, seed: int = 0) -> Policy:
    """A policy by name; an unknown name raises BadRouterInput listing the known ones."""
    try:
        cls = _CLASSES[name]
    except KeyError:
        raise BadRouterInput(
            f"unknown policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None
    return cls(settings, seed)
