"""Local group coverage: how much of the calibration traffic its home node could serve itself.

OrderMoE's placement is judged by it (the paper: 88% at memory ratio 2.0). Here it is defined
with the router's own rules, so that it counts what the router could really use:

    an *expert use* is one (token, MoE layer, top-k slot) of the calibration traffic, with its
    expert e, gate weight w and the token's home node h. The use is *covered* when h holds a
    replica r (any precision, either tier) of e itself or of one of e's substitutes (experts
    whose router-logit similarity to e reaches the layer's threshold, `QualityTable.substitutes`)
    whose quality price fits the token's budget spread evenly over its MoE layers:
    w x penalty(e, r) <= budget / layers (a token taking such a replica at every layer stays
    within its budget). coverage = covered uses / all uses.

Each use counts once (a share of expert executions, as the paper's "83% local"), not weighted
by gate mass. A replica the budget rules out for a use (a poor substitute, a lossy int4 copy
when the budget is spread over 32 layers) does not cover it: it is not a copy the router could
keep using. `CoverageState` keeps, per (home, layer, expert),
the least penalty a local replica offers, so a greedy placement can ask what one more replica
would add.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from moe.vocab import VARIANTS
from router.types import Replica

from .problem import PlacementProblem

__all__ = ["CoverageState", "admits", "local_group_coverage"]


def admits(weight: np.ndarray, price: Any, spread: float) -> np.ndarray:
    """Which uses, by gate weight, a local replica at quality `price` covers: a free one all,
    else those with weight x price within the budget spread over the layers (module
    docstring). `price` may be one value or one per use (inf: none there)."""
    with np.errstate(invalid="ignore"):
        return (price <= 0) | (weight * price <= spread)


class CoverageState:
    """Least local penalty per (home, layer, expert) and the covered uses it implies."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.p = problem
        q = problem.quality
        self.budget = problem.settings.budget / problem.layers  # per use, spread evenly
        self.least = np.full((problem.nodes, problem.layers, problem.experts), np.inf)
        self.demand = problem.demand()  # [h, l, e] uses per token
        # served_by[l][x]: (e, substitution penalty) for every e that a replica of x can serve
        self.served_by = [[[(x, 0.0)] for x in range(problem.experts)]
                          for _ in range(problem.layers)]
        for layer in range(problem.layers):
            for e in range(problem.experts):
                for x, pen in q.substitutes(layer, e):
                    self.served_by[layer][x].append((e, pen))
        # per (l, e): the gate weights of its uses, sorted, for the share a penalty admits
        _, flat_layer, flat_e, flat_w = problem.uses()
        order = np.lexsort((flat_w, flat_e, flat_layer))
        self._w = flat_w[order]
        key = flat_layer[order] * problem.experts + flat_e[order]
        cells = np.arange(problem.layers * problem.experts)
        self._start = np.searchsorted(key, cells)
        self._stop = np.searchsorted(key, cells, side="right")

    def admitted(self, layer: int, e: int, penalty: float) -> float:
        """Share of e's uses whose gate weight lets a replica with this penalty serve them."""
        if not np.isfinite(penalty):
            return 0.0
        if penalty <= 0:
            return 1.0
        i = layer * self.p.experts + e
        lo, hi = int(self._start[i]), int(self._stop[i])
        if hi == lo:
            return 1.0
        inside = np.searchsorted(self._w[lo:hi], self.budget / penalty, side="right")
        return float(inside) / (hi - lo)

    def _offers(self, layer: int, x: int, variant: str) -> list[tuple[int, float]]:
        quant = self.p.quality.quant_penalty(layer, x, variant)
        return [(e, quant + pen) for e, pen in self.served_by[layer][x]]

    def gain(self, n: int, layer: int, x: int, variant: str) -> float:
        """Uses per token that one more replica (x, variant) on node n would newly cover."""
        total = 0.0
        for e, pen in self._offers(layer, x, variant):
            d = self.demand[n, layer, e]
            old = self.least[n, layer, e]
            if d > 0 and pen < old:
                total += d * (self.admitted(layer, e, pen) - self.admitted(layer, e, old))
        return total

    def add(self, n: int, layer: int, x: int, variant: str) -> None:
        for e, pen in self._offers(layer, x, variant):
            if pen < self.least[n, layer, e]:
                self.least[n, layer, e] = pen

    def share(self) -> float:
        """Covered uses / all uses, use by use (gate weights per token, not pooled)."""
        homes, layer, expert, weight = self.p.uses()
        return float(np.mean(admits(weight, self.least[homes, layer, expert], self.budget)))


def local_group_coverage(problem: PlacementProblem, replicas: Iterable[Replica]) -> float:
    """The coverage of a placement (module docstring), in [0, 1]."""
    state = CoverageState(problem)
    index = {name: i for i, name in enumerate(problem.names)}
    for r in replicas:
        if r.variant in VARIANTS:
            state.add(index[r.node], r.layer, r.expert, r.variant)
    return state.share()
