"""local-first: the home node's own replica when it has one, else the nearest holder.

"Nearest" is the smallest round-trip propagation delay; among the home's replicas (or among
equally near holders) full precision beats quantized and GPU beats CPU. Load is ignored; the
quality budget is not (a quantized copy that does not fit is skipped)."""

from __future__ import annotations

from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, build_plan, exact_options, excluded, infeasible
from .search import Option, sequential

__all__ = ["LocalFirst"]


class LocalFirst(Policy):
    name = "local-first"

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        lam = self.settings.quality_ms
        skip = excluded(view, req)
        home = view.home_index
        delay = view.delay
        opts = [
            exact_options(view, req, slot, lam, skip, stable_only=False)
            for slot in range(len(req.experts))
        ]

        def nearest(fits: list[Option]) -> Option:
            return min(
                fits, key=lambda x: (x.node != home, delay[x.node], x.penalty,
                                     x.payload.load_bytes > 0, x.node)
            )

        base = view.base(req.rows, req.batch)
        picks = sequential(base, opts, req.budget_left, nearest)
        if picks is None:
            raise infeasible(view, req, skip)
        return build_plan(view, req, picks, base)
