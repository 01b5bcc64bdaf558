"""random: a uniformly random reachable replica of each expert (a sanity baseline).

Seeded, so a run repeats; quantized replicas that would overrun the budget are not drawn."""

from __future__ import annotations

import random

from ..settings import Settings
from ..tables import PlanView
from ..types import Plan, PlanRequest
from .base import Policy, plan_exact_in_slot_order
from .search import Option

__all__ = ["RandomPolicy"]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, settings: Settings | None = None, seed: int = 0) -> None:
        super().__init__(settings, seed)
        self.rng = random.Random(seed)

    def plan(self, view: PlanView, req: PlanRequest) -> Plan:
        def draw(fits: list[Option]) -> Option:
            return fits[self.rng.randrange(len(fits))]

        return plan_exact_in_slot_order(view, req, self.settings.quality_ms, draw)
