"""exact: every expert computed exactly, in full precision, on the home node (no network).

The quality reference: placement is ignored, so the dispatcher runs these items with the home
node's own copy of the model. The predicted latency is the home node's compute alone."""

from __future__ import annotations

from moe.vocab import FULL_PRECISION

from ..tables import Candidate, PlanView
from ..types import Choice, Plan, PlanRequest, Replica
from .base import Policy

__all__ = ["Exact"]


class Exact(Policy):
    name = "exact"
    in_process = True

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        home = view.home_index
        choices = []
        lat = view.base(req.rows, req.batch)[home]
        for slot, e in enumerate(req.experts):
            r = Replica(req.layer, e, view.home, FULL_PRECISION, "gpu")
            lat += view.var_ms(Candidate(r, home, e, 0.0, 0, "exact"), req.rows)
            choices.append(Choice(slot, e, req.weights[slot], r, "exact", 0.0))
        return Plan(req.layer, tuple(choices), lat, 0.0, lat)
