"""local-first: the home node's own replica when it has one, else the nearest holder.

"Nearest" is the smallest round-trip propagation delay; among the home's replicas (or among
equally near holders) full precision beats quantized and GPU beats CPU. Load is ignored; the
quality budget is not (a quantized copy that does not fit is skipped)."""

from __future__ import annotations

from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, plan_exact_in_slot_order
from .search import Option

__all__ = ["LocalFirst"]


class LocalFirst(Policy):
    name = "local-first"

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        home = view.home_index
        delay = view.delay

        def nearest(fits: list[Option]) -> Option:
            return min(
                fits, key=lambda x: (x.node != home, delay[x.node], x.penalty,
                                     x.payload.load_bytes > 0, x.node)
            )

        return plan_exact_in_slot_order(view, req, self.settings.quality_ms, nearest)
