"""Routing policies, one module each behind one interface (`Policy.plan`).

`make_policy(name, settings, seed)` builds one by name; `POLICIES` lists the names. Besides the
built-in ones, any installed package may add policies through the entry-point group
`moemesh.policies` (docs/extending.md): each entry point's name is the policy's name and its
object a `Policy` subclass, or any callable `(settings, seed) -> Policy`. Entry points are
listed at import (names only) and loaded when a policy of theirs is made, so a broken plug-in
fails the run that asks for it, naming the entry point, and no other. A built-in name always
means the built-in policy: an entry point of that name is not used.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

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

__all__ = ["BUILTIN_MESH_POLICIES", "ENTRY_POINT_GROUP", "MESH_POLICIES", "POLICIES", "Policy",
           "make_policy"]

ENTRY_POINT_GROUP = "moemesh.policies"

_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (LocalFirst, RandomPolicy, Greedy, HetRoute, OrderMoE, HetRouteOrderMoE, Exact)
}


def _plugin_entry_points() -> dict[str, EntryPoint]:
    """The group's entry points by name (listed, not loaded), built-in names left out."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _CLASSES:
            found.setdefault(ep.name, ep)
    return found


def _dist(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"package {dist.name}" if dist is not None else "an unknown package"


_PLUGINS = _plugin_entry_points()
POLICIES = (*_CLASSES, *sorted(_PLUGINS))
# What a scenario's plain `policies:` list may name: all but `exact`, which serves the home
# node's own model with no network and is only ever an arm (orchestrator/scenario/arms.py).
MESH_POLICIES = tuple(name for name in POLICIES if _CLASSES.get(name) is not Exact)
# A scenario without a `policies:` list runs these: installing a plug-in changes no scenario.
BUILTIN_MESH_POLICIES = tuple(name for name, cls in _CLASSES.items() if cls is not Exact)


def _load(ep: EntryPoint) -> Callable[[Settings | None, int], Policy]:
    try:
        return ep.load()
    except Exception as exc:  # any import-time failure of someone else's package
        raise BadRouterInput(f"policy plug-in {ep.name!r} (entry point {ep.value} in "
                             f"{_dist(ep)}) failed to load: {type(exc).__name__}: {exc}"
                             ) from exc


def make_policy(name: str, settings: Settings | None = None, seed: int = 0) -> Policy:
    """A policy by name; an unknown name raises BadRouterInput listing the known ones, a
    plug-in that fails to load or to build one names its entry point."""
    if name in _CLASSES:
        return _CLASSES[name](settings, seed)
    ep = _PLUGINS.get(name)
    if ep is None:
        raise BadRouterInput(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    policy = _load(ep)(settings, seed)
    if not isinstance(policy, Policy):
        raise BadRouterInput(f"policy plug-in {name!r} (entry point {ep.value}) made a "
                             f"{type(policy).__name__}, not a router.policies.Policy")
    return policy
