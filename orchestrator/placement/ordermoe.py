"""OrderMoE's placement: similarity groups spread over the nodes, then benefit per byte.

Groups (per layer) form around the most used experts: the most used expert not yet grouped
leads a group, and every ungrouped expert whose router-logit similarity to it reaches the
layer's threshold joins it (the quality tables' similarity and thresholds, about 0.9 in shallow
layers down to 0.5 in deep ones). Every expert is placed once in fp16, the members of one
group on different nodes (the node holding fewest of its group, busier homes first), so most
nodes hold some member of most groups. Leftover memory, up to the redundancy budget, goes by
benefit per byte: first a group's most used member on a node that has no member of it
(users homed there x the group's frequency), then frequent experts where they are missing.
`notes` reports the local group coverage: the share of expert uses (calibration traffic) whose
group has a member on the token's home node.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from .base import Ledger, Policy, need_one_copy, popularity_benefit, retier
from .problem import PlacementError, PlacementProblem

__all__ = ["OrderMoEPlacement", "similarity_groups"]


def similarity_groups(similarity: np.ndarray, threshold: float, pop: np.ndarray
                      ) -> list[list[int]]:
    """One layer's groups, each led by its most used member, most used group first."""
    order = sorted(range(len(pop)), key=lambda e: (-pop[e], e))
    grouped: set[int] = set()
    groups = []
    for leader in order:
        if leader in grouped:
            continue
        members = [leader] + [j for j in order if j not in grouped and j != leader
                              and similarity[leader, j] >= threshold]
        grouped.update(members)
        groups.append(members)
    return groups


class OrderMoEPlacement(Policy):
    name = "ordermoe"

    def place(self, problem: PlacementProblem, rng: random.Random) -> Ledger:
        need_one_copy(problem)
        ledger = Ledger(problem)
        pop = problem.popularity()
        q = problem.quality
        self._groups = [similarity_groups(q.similarity[layer], float(q.thresholds[layer]),
                                          pop[layer]) for layer in range(problem.layers)]
        shares = problem.home_shares
        homes = sorted(range(problem.nodes), key=lambda n: (-shares[n], n))
        for layer, groups in enumerate(self._groups):
            for group in groups:
                count = [0] * problem.nodes
                for e in group:
                    fitting = [n for n in homes if ledger.best_tier(n, "fp16") is not None]
                    if not fitting:
                        raise PlacementError(f"no node has room for expert {e} of layer "
                                             f"{layer} after {len(ledger.tier)} replicas")
                    n = min(fitting, key=lambda i: (count[i], homes.index(i)))
                    count[n] += 1
                    ledger.add((n, layer, e, "fp16"), ledger.best_tier(n, "fp16") or "cpu")
        self._fill(ledger, pop)
        retier(ledger, popularity_benefit(problem))
        return ledger

    def _fill(self, ledger: Ledger, pop: np.ndarray) -> None:
        p = ledger.p
        b = ledger.size["fp16"]
        shares = p.home_shares
        candidates: list[tuple[float, int, int, int, int]] = []  # (-benefit, stage, n, l, e)
        for layer, groups in enumerate(self._groups):
            for group in groups:
                freq = float(sum(pop[layer, e] for e in group))
                for n in range(p.nodes):
                    if not any(ledger.has(n, layer, e, "fp16") for e in group):
                        candidates.append((-shares[n] * freq / b, 0, n, layer, group[0]))
            for e in range(p.experts):
                for n in range(p.nodes):
                    if not ledger.has(n, layer, e, "fp16"):
                        candidates.append((-shares[n] * float(pop[layer, e]) / b, 1, n, layer,
                                           e))
        for neg, _, n, layer, e in sorted(candidates, key=lambda c: (c[1], c[0], c[2:])):
            if ledger.total + b > p.budget_bytes:
                break
            tier = ledger.best_tier(n, "fp16")
            if neg >= 0 or tier is None or ledger.has(n, layer, e, "fp16"):
                continue
            ledger.add((n, layer, e, "fp16"), tier)

    def notes(self, problem: PlacementProblem, ledger: Ledger) -> dict[str, Any]:
        groups = getattr(self, "_groups", None)
        if groups is None:
            return {}
        return {"groups": sum(len(g) for g in groups),
                "local_group_coverage": float(group_coverage(problem, ledger, groups))}


def group_coverage(problem: PlacementProblem, ledger: Ledger,
                   groups: list[list[list[int]]]) -> float:
    """Share of calibration expert uses whose similarity group has a member at the token's
    home (OrderMoE's "local similarity coverage")."""
    demand = problem.demand()  # [h, l, e]
    covered = total = 0.0
    for layer, layer_groups in enumerate(groups):
        for group in layer_groups:
            use = demand[:, layer, group].sum(axis=1)
            for h in range(problem.nodes):
                total += use[h]
                if any(ledger.has(h, layer, e, v) for e in group for v in ledger.size):
                    covered += use[h]
    return covered / total if total else 0.0
