"""random: a uniformly random reachable replica of each expert (a sanity baseline).

Seeded, so a run repeats; quantized replicas that would overrun the budget are not drawn."""

from __future__ import annotations

import random

from ..settings import Settings
from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, build_plan, exact_options, excluded, infeasible
from .search import Option, sequential

__all__ = ["RandomPolicy"]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, settings: Settings | None = None, seed: int = 0) -> None:
        super().__init__(settings, seed)
        self.rng = random.Random(seed)

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        lam = self.settings.quality_ms
        skip = excluded(view, req)
        opts = [
            exact_options(view, req, slot, lam, skip, stable_only=False)
            for slot in range(len(req.experts))
        ]

        def draw(fits: list[Option]) -> Option:
            return fits[self.rng.randrange(len(fits))]

        base = view.base(req.rows, req.batch)
        picks = sequential(base, opts, req.budget_left, draw)
        if picks is None:
            raise infeasible(view, req, skip)
        return build_plan(view, req, picks, base)
