"""Popularity-based replication (a baseline of the OrderMoE paper): copy the most used experts.

Every expert once, spread round-robin over the nodes (busiest homes first); then fp16 copies of
the most popular experts (calibration traffic, all layers together) on every node that lacks
them, until the redundancy budget or the memory runs out. GPU residency by popularity x load
time. Precision is always fp16: this baseline never quantizes.
"""

from __future__ import annotations

import itertools
import random

from moe.vocab import FULL_PRECISION

from .base import Ledger, Policy, retier_by_popularity, spread_base

__all__ = ["PopularityPlacement"]


class PopularityPlacement(Policy):
    name = "popularity"

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        problem = ledger.p
        pop = problem.popularity()
        experts = sorted(((layer, e) for layer in range(problem.layers)
                          for e in range(problem.experts)), key=lambda le: (-pop[le], le))
        homes = sorted(range(problem.nodes), key=lambda n: (-problem.home_shares[n], n))
        turn = itertools.cycle(homes)

        def next_fitting(layer: int, e: int, fitting: list[int]) -> int:
            while True:
                n = next(turn)
                if n in fitting:
                    return n

        spread_base(ledger, sorted(experts), next_fitting)
        for layer, e in experts:
            for n in homes:
                if ledger.has(n, layer, e, FULL_PRECISION):
                    continue
                tier = ledger.best_tier(n, FULL_PRECISION)
                if tier is not None:
                    ledger.add((n, layer, e, FULL_PRECISION), tier)
            if ledger.total + ledger.size[FULL_PRECISION] > problem.budget_bytes:
                break
        retier_by_popularity(ledger)
