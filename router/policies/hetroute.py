"""HetRoute: the whole top-k set assigned jointly to minimise the bottleneck plus quality.

Per slot, in HetRoute's order: exact replicas (fp16 or quantized) on reachable, stable nodes
that fit the token's remaining budget; similarity substitutes only when no exact replica
survives; a reachable full-precision replica as the fallback, relaxing load but never quality.
Then one joint search over the slots (exhaustive up to `exhaustive_limit` assignments, beam +
one-swap beyond, seeded with the greedy pick). If the survivors cannot be combined within the
budget, the fallbacks join every slot and the search runs again; an all-fp16 pick spends
nothing, so a plan exists whenever every expert has a reachable full-precision replica.

The objective also prices the bytes the plan moves (`Settings.traffic_weight`: the link time
of one row out and one answer back per remote node used, counted once per node), which the
bottleneck alone does not see: a token whose experts share a node moves its row once. Where
the home has an access link (`uplink_mbit`, `downlink_mbit`), each remote node used also puts
the rows through its uplink, and its answer through its downlink, once more, which every
remote branch waits for (`PlanView.spread`): the joint search sees that scattering costs
latency, not only traffic.

The aggregation node is always the home node here (the dense part runs there,
docs/architecture.md), so HetRoute's one-step lookahead for the next aggregation server has
nothing to choose.
"""

from __future__ import annotations

from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, add_fallbacks, build_plan, excluded, hetroute_options, infeasible
from .search import joint

__all__ = ["HetRoute"]


class HetRoute(Policy):
    name = "hetroute"
    substitutes_always = False
    lookahead = False

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        s = self.settings
        lam = s.quality_ms
        skip = excluded(view, req)
        future = view.future(s.lookahead)[req.layer] if self.lookahead else None
        opts, extras = hetroute_options(
            view, req, lam, skip,
            substitutes_always=self.substitutes_always,
            future=future,
            lookahead_weight=s.lookahead_weight if self.lookahead else 0.0,
        )
        base = view.base(req.rows, req.batch)  # a node's rows cross its link once: sharing it pays
        # their bytes are priced once, and each remote node queues on the home's access link
        once = view.spread(req.rows, s.traffic_weight)
        args = (s.exhaustive_limit, s.beam_width, s.swap_passes, once)
        picks = joint(base, opts, req.budget_left, *args)
        if picks is None:
            add_fallbacks(view, req, opts, lam, skip, extras)
            picks = joint(base, opts, req.budget_left, *args)
            if picks is None:
                raise infeasible(view, req, skip)
        return build_plan(view, req, picks, base, once)
