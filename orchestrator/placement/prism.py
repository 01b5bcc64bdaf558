"""Prism-like frequency-based distributed expert placement (HetRoute's strongest baseline).

Prism's exact rules are not public (docs/papers.md); this follows its one-line summary. Every expert
once in fp16, each on the node whose expected expert work per unit of compute is lowest so far
(frequency balancing). The redundancy budget becomes replica slots, shared among layers in
proportion to exp(activation entropy): a layer whose traffic spreads over many experts needs
more copies to cover it. Within a layer, slots go greedily to the (node, expert) that covers the
most not-yet-local traffic: users homed at the node x the expert's frequency. GPU residency by
frequency x load time. fp16 only.
"""

from __future__ import annotations

import math
import random

import numpy as np

from .base import Ledger, Policy, need_one_copy, popularity_benefit, retier, spread_base
from .problem import PlacementProblem

__all__ = ["PrismPlacement", "layer_slots"]


def layer_slots(pop: np.ndarray, top_k: int, slots: int) -> list[int]:
    """Extra replica slots per layer, in proportion to exp(entropy of its activations)."""
    p = pop / max(top_k, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    weight = np.exp(ent)
    share = weight / weight.sum() * slots
    out = [math.floor(s) for s in share]
    for i in np.argsort(-(share - np.floor(share)))[: slots - sum(out)]:
        out[int(i)] += 1
    return out


class PrismPlacement(Policy):
    name = "prism"

    def place(self, problem: PlacementProblem, rng: random.Random) -> Ledger:
        need_one_copy(problem)
        ledger = Ledger(problem)
        pop = problem.popularity()
        tflops = [problem.estimates.node(n).flops_per_s for n in problem.names]
        work = [0.0] * problem.nodes
        order = sorted(((layer, e) for layer in range(problem.layers)
                        for e in range(problem.experts)), key=lambda le: (-pop[le], le))

        def least_loaded(layer: int, e: int, fitting: list[int]) -> int:
            n = min(fitting, key=lambda i: ((work[i] + pop[layer, e]) / tflops[i], i))
            work[n] += float(pop[layer, e])
            return n

        spread_base(ledger, order, least_loaded)
        b16 = ledger.size["fp16"]
        slots = max(0, (problem.budget_bytes - ledger.total) // b16)
        shares = problem.home_shares
        for layer, count in enumerate(layer_slots(pop, problem.top_k, slots)):
            for _ in range(count):
                best: tuple[float, int, int] | None = None
                for n in range(problem.nodes):
                    if ledger.best_tier(n, "fp16") is None:
                        continue
                    for e in range(problem.experts):
                        gain = shares[n] * float(pop[layer, e])
                        if not ledger.has(n, layer, e, "fp16") and (
                                best is None or gain > best[0]):
                            best = (gain, n, e)
                if best is None or best[0] <= 0:
                    break
                _, n, e = best
                ledger.add((n, layer, e, "fp16"), ledger.best_tier(n, "fp16") or "cpu")
        retier(ledger, popularity_benefit(problem))
        return ledger
