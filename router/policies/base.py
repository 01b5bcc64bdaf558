"""The one interface every policy has, and the candidate filters they share.

A policy turns a `PlanRequest` (one token's top-k experts at one layer, its gate weights and
what is left of its quality budget) into a `Plan` against a `PlanView` (candidate tables and
cost coefficients). Policies never do I/O; they raise `NoFeasiblePlan` when some expert has
no reachable replica at all. Every policy keeps a plan's quality spend within the budget:
full-precision exact replicas spend nothing, so they always fit.

Filters (HetRoute's order): `exact_options` are replicas of the expert itself (fp16 or
quantized) on reachable nodes, optionally only stable ones (queue below capacity), each
fitting the budget alone; `substitute_options` are replicas of similar experts that fit;
`fallback_options` are reachable full-precision replicas whatever their load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from moe.vocab import FULL_PRECISION

from ..errors import NoFeasiblePlan
from ..settings import Settings
from ..tables import Candidate, PlanView
from ..types import Choice, Plan, PlanRequest
from .search import EPS, Option, evaluate, sequential

__all__ = [
    "Policy",
    "add_fallbacks",
    "build_plan",
    "exact_options",
    "excluded",
    "fallback_options",
    "hetroute_options",
    "infeasible",
    "plan_exact_in_slot_order",
    "substitute_options",
]
_new_tuple = tuple.__new__


class Policy(ABC):
    """Plans one layer for one token. `in_process` policies ignore placement: the home node
    computes every expert with its own copy of the model (the `exact` reference)."""

    name: str = ""
    in_process: bool = False

    def __init__(self, settings: Settings | None = None, seed: int = 0) -> None:
        self.settings = settings or Settings()
        self.seed = seed

    @abstractmethod
    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        """The assignment of every slot of `req`; raises NoFeasiblePlan."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def excluded(view: PlanView, req: PlanRequest) -> set[int]:
    """Node indices this token may not use: breakers open, or failed earlier in the layer."""
    out = set(view.down())
    for name in req.exclude:
        i = view.index.get(name)
        if i is not None:
            out.add(i)
    return out


def _option(
    view: PlanView, c: Candidate, weight: float, req: PlanRequest, lam: float, extra: float,
    kind: str
) -> Option:
    pen = weight * c.penalty
    calls = req.calls
    if calls:  # rows of this batch already call it there: it reads its weights once
        var = view.var_ms(c, req.rows, calls.get((c.node, c.replica.key), 0))
    else:
        var = view.var_ms(c, req.rows)
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (2x faster: the hot path)
    return _new_tuple(Option, (c.node, var, pen, lam * pen + extra, c, kind))


def exact_options(
    view: PlanView,
    req: PlanRequest,
    slot: int,
    lam: float,
    skip: set[int],
    *,
    stable_only: bool,
    budget: float | None = None,
    extra: float = 0.0,
) -> list[Option]:
    """Replicas of the expert itself that are reachable (and stable) and fit the budget."""
    left = (req.budget_left if budget is None else budget) + EPS
    w = req.weights[slot]
    stable = view.stable
    out = []
    for c in view.exact(req.layer, req.experts[slot]):
        if c.node in skip or (stable_only and not stable[c.node]):
            continue
        if w * c.penalty > left:
            continue
        out.append(_option(view, c, w, req, lam, extra, c.kind))
    return out


def substitute_options(view: PlanView, req: PlanRequest, slot: int, lam: float,
                       skip: set[int], *, stable_only: bool, budget: float | None = None,
                       future: Sequence[float] | None = None, lookahead_weight: float = 0.0,
                       ) -> list[Option]:
    """Replicas of similar experts (not already in the token's top-k) that fit the budget;
    `future[j]` adds OrderMoE's expected future cost of running expert j."""
    left = (req.budget_left if budget is None else budget) + EPS
    w = req.weights[slot]
    taken = req.experts
    out = []
    for c in view.substitutes(req.layer, req.experts[slot]):
        if c.node in skip or (stable_only and not view.stable[c.node]):
            continue
        if c.replica.expert in taken or w * c.penalty > left:
            continue
        extra = lookahead_weight * w * future[c.replica.expert] if future is not None else 0.0
        out.append(_option(view, c, w, req, lam, extra, "substitute"))
    return out


def fallback_options(
    view: PlanView, req: PlanRequest, slot: int, lam: float, skip: set[int], extra: float = 0.0
) -> list[Option]:
    """Reachable full-precision replicas of the expert, load ignored (never quality)."""
    w = req.weights[slot]
    return [
        _option(view, c, w, req, lam, extra, "fallback")
        for c in view.exact(req.layer, req.experts[slot])
        if c.node not in skip and c.replica.variant == FULL_PRECISION
    ]


def hetroute_options(
    view: PlanView,
    req: PlanRequest,
    lam: float,
    skip: set[int],
    *,
    substitutes_always: bool = False,
    future: Sequence[float] | None = None,
    lookahead_weight: float = 0.0,
) -> tuple[list[list[Option]], list[float]]:
    """Per slot, HetRoute's survivors: exact replicas on reachable stable nodes that fit;
    substitutes when none survives (or always); else the full-precision fallback. Returns
    the option lists and each slot's lookahead term; raises NoFeasiblePlan for a slot with
    nothing at all."""
    if future is None:
        extras = [0.0] * len(req.experts)
    else:
        extras = [lookahead_weight * w * future[e]
                  for e, w in zip(req.experts, req.weights, strict=True)]
    opts = []
    for slot in range(len(req.experts)):
        o = exact_options(view, req, slot, lam, skip, stable_only=True, extra=extras[slot])
        if substitutes_always or not o:
            o += substitute_options(
                view, req, slot, lam, skip, stable_only=True,
                future=future, lookahead_weight=lookahead_weight,
            )
        if not o:
            o = fallback_options(view, req, slot, lam, skip, extras[slot])
        if not o:
            raise infeasible(view, req, skip, slot)
        opts.append(o)
    return opts, extras


def add_fallbacks(
    view: PlanView,
    req: PlanRequest,
    opts: list[list[Option]],
    lam: float,
    skip: set[int],
    extras: Sequence[float],
) -> None:
    """Give every slot its reachable full-precision replicas too (when the survivors cannot
    be combined within the budget): an all-fp16 pick spends nothing, so one then exists."""
    for slot, o in enumerate(opts):
        have = {id(x.payload) for x in o}
        o.extend(
            f for f in fallback_options(view, req, slot, lam, skip, extras[slot])
            if id(f.payload) not in have
        )


def infeasible(
    view: PlanView, req: PlanRequest, skip: set[int], slot: int | None = None
) -> NoFeasiblePlan:
    """The error for the first slot (or `slot`) without a reachable full-precision replica."""
    slots = range(len(req.experts)) if slot is None else [slot]
    for i in slots:
        cands = view.exact(req.layer, req.experts[i])
        if not any(c.node not in skip and c.replica.variant == FULL_PRECISION for c in cands):
            break
    else:
        i = slots[0]
    cands = view.exact(req.layer, req.experts[i])
    if not cands:
        return NoFeasiblePlan(req.layer, req.experts[i], "the placement holds no replica of it")
    fp16 = sorted({view.names[c.node] for c in cands if c.replica.variant == FULL_PRECISION})
    down = sorted({view.names[c.node] for c in cands if c.node in skip})
    return NoFeasiblePlan(
        req.layer,
        req.experts[i],
        f"no full-precision replica reachable (fp16 holders: {', '.join(fp16) or 'none'}; "
        f"unreachable now: {', '.join(down) or 'none'}) and no quantized replica or "
        f"substitute fits the remaining budget {req.budget_left:.4g}",
    )


def plan_exact_in_slot_order(view: PlanView, req: PlanRequest, lam: float,
                             choose: Callable[[list[Option]], Option]) -> Plan:
    """The plan of the simple baselines: each slot, in order, takes `choose` of its expert's
    own reachable replicas that leave the later slots their budget (`search.sequential`)."""
    skip = excluded(view, req)
    opts = [exact_options(view, req, slot, lam, skip, stable_only=False)
            for slot in range(len(req.experts))]
    base = view.base(req.rows, req.batch)
    picks = sequential(base, opts, req.budget_left, choose)
    if picks is None:
        raise infeasible(view, req, skip)
    return build_plan(view, req, picks, base)


def build_plan(view: PlanView, req: PlanRequest, picks: Sequence[Option],
               base: Sequence[float] | None = None, once: Sequence[float] | None = None
               ) -> Plan:
    """The Plan of one complete pick, with the compiled cost model's prediction (`base`: the
    nodes' `PlanView.base` for the request's rows, if the caller has it already; `once`: the
    traffic prices the objective counted, if any). The predicted latency includes the plan's
    burst on the home's access link (`PlanView.access_ms`), whichever policy made it."""
    j, lat, pen = evaluate(view.base(req.rows, req.batch) if base is None else base, picks,
                           once)
    if view.access:
        lat += view.access_ms(req.rows, [o.node for o in picks])
    experts, weights = req.experts, req.weights
    choices = tuple([
        Choice(slot, experts[slot], weights[slot], o.payload.replica, o.kind, o.penalty)
        for slot, o in enumerate(picks)
    ])
    return Plan(req.layer, choices, lat, pen, j)
