"""Random deployment (a baseline of the OrderMoE paper): replicas wherever chance puts them.

Every expert once in fp16 on a random node with room, then random extra replicas (random node,
expert and allowed precision, in a random tier where it fits) until the redundancy budget is
spent or 200 draws in a row found no room. Seeded: the same seed, the same placement.
"""

from __future__ import annotations

import random

from .base import TIERS, Ledger, Policy, spread_base

__all__ = ["RandomPlacement"]

MAX_MISSES = 200


class RandomPlacement(Policy):
    name = "random"

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        problem = ledger.p
        order = [(layer, e) for layer in range(problem.layers) for e in range(problem.experts)]
        rng.shuffle(order)
        spread_base(ledger, order, lambda layer, e, fitting: rng.choice(fitting))
        misses = 0
        smallest = min(ledger.size.values())
        while misses < MAX_MISSES and ledger.total + smallest <= problem.budget_bytes:
            n = rng.randrange(problem.nodes)
            layer, e = rng.randrange(problem.layers), rng.randrange(problem.experts)
            variant = rng.choice(problem.variants)
            tiers = [t for t in TIERS if ledger.fits(n, variant, t)]
            if ledger.has(n, layer, e, variant) or not tiers:
                misses += 1
                continue
            ledger.add((n, layer, e, variant), rng.choice(tiers))
            misses = 0
