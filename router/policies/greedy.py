"""Per-expert greedy (HetRoute's ablation): HetRoute's candidates, but each expert goes to its
own cheapest replica alone (standalone branch cost plus priced quality), blind to where the
other experts go and to the bottleneck they make together."""

from __future__ import annotations

from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, add_fallbacks, build_plan, excluded, hetroute_options, infeasible
from .search import greedy

__all__ = ["Greedy"]


class Greedy(Policy):
    name = "greedy"

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        lam = self.settings.quality_ms
        skip = excluded(view, req)
        opts, extras = hetroute_options(view, req, lam, skip)
        base = view.base(req.rows, req.batch)
        # charged to every slot as if it were its node's only one: a slot alone pays its own
        # turn on the home's access link, never the turns the other slots' nodes add
        once = view.spread(req.rows, self.settings.traffic_weight)
        picks = greedy(base, opts, req.budget_left, once)
        if picks is None:
            add_fallbacks(view, req, opts, lam, skip, extras)
            picks = greedy(base, opts, req.budget_left, once)
            if picks is None:
                raise infeasible(view, req, skip)
        return build_plan(view, req, picks, base, once)
