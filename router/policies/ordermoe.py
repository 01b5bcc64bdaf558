"""OrderMoE's controller: per expert, the exact expert on any holder or a similar expert.

Candidates for each slot: the expert itself on any reachable holder (any precision that fits)
plus replicas of same-group substitutes (similarity above the layer's threshold) whose loss
fits the remaining budget. Cost = communication + compute + server load (the standalone branch
cost, queue wait included) + the loss priced in ms + the expected cost of the next H layers'
experts from the layer-to-layer transition statistics. Slots decide one at a time, in gate
order, each within the budget the earlier ones left; the cheapest wins.
"""

from __future__ import annotations

from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import (
    Policy,
    build_plan,
    exact_options,
    excluded,
    infeasible,
    substitute_options,
)
from .search import Option, sequential

__all__ = ["OrderMoE"]


class OrderMoE(Policy):
    name = "ordermoe"

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        s = self.settings
        lam = s.quality_ms
        skip = excluded(view, req)
        future = view.future(s.lookahead)[req.layer]
        la = s.lookahead_weight
        fixed = view.base(req.rows, req.batch)
        spread = view.spread(req.rows, 0.0)  # a remote slot's own turn on the home's uplink
        price = spread if spread is not None else [0.0] * len(fixed)
        opts = []
        for slot, e in enumerate(req.experts):
            extra = la * req.weights[slot] * future[e]
            o = exact_options(view, req, slot, lam, skip, stable_only=False, extra=extra)
            o += substitute_options(
                view, req, slot, lam, skip, stable_only=False,
                future=future, lookahead_weight=la,
            )
            opts.append(o)

        def cheapest(fits: list[Option]) -> Option:
            return min(fits, key=lambda x: fixed[x.node] + x.var + x.add + price[x.node])

        picks = sequential(fixed, opts, req.budget_left, cheapest)
        if picks is None:
            raise infeasible(view, req, skip)
        return build_plan(view, req, picks, fixed, spread)
