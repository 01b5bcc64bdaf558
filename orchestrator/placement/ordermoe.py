"""OrderMoE's placement: local group coverage per byte, GPU tier first, every expert once in fp16.

Groups (per layer) form around the most used experts: the most used expert not yet grouped
leads a group, and every ungrouped expert whose router-logit similarity to it reaches the
layer's threshold joins it (the quality tables' similarity and thresholds, about 0.9 in shallow
layers down to 0.5 in deep ones).

The placement maximises local group coverage (`orchestrator.placement.coverage`: the share of
expert uses whose expert, or a substitute the router may take within the token's budget, has a
replica on the token's home node), greedily by coverage gained per byte:

1. *Fill*: replicas (node, expert, precision among the scenario's variants) in the GPU tier,
   highest gain per byte first (a lazy heap: gains only shrink as replicas are added). Budget
   and GPU room for the one fp16 copy every expert still needs are held back.
2. *Base*: every expert without an fp16 replica gets one, most used first: an upgrade of its
   low-precision copy on the node where that copy covers most (the upgrade keeps the coverage
   and frees the small copy's bytes), else on the node with GPU room where it covers most,
   ties to the node holding fewest members of its group (the paper's spread of a group over
   servers). The CPU tier only when no node has GPU room for it.
3. *Fill* again with what step 2 left. (When memory is so tight that step 1 left no way to
   place the fp16 copies, the placement starts over with step 2 first.)

The CPU tier is never used while any node has GPU room (GPU tier first): a CPU-tier replica
pays its host-to-device copy on every use in the offline view, and these are the copies that
made the earlier version of this placement lose to random deployment. `notes` reports the
group count (`place` adds the coverage, for every policy).
"""

from __future__ import annotations

import heapq
import random
from typing import Any

import numpy as np

from moe.vocab import FULL_PRECISION

from .base import Ledger, Policy, retier_by_popularity
from .coverage import CoverageState
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

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        p = ledger.p
        pop = p.popularity()
        q = p.quality
        groups = [similarity_groups(q.similarity[layer], float(q.thresholds[layer]),
                                    pop[layer]) for layer in range(p.layers)]
        self._groups = groups
        self._group_of = {(layer, e): i for layer, gs in enumerate(groups)
                          for i, g in enumerate(gs) for e in g}
        try:
            cov = CoverageState(p)
            self._fill(ledger, cov)
            self._base(ledger, cov, pop)
        except PlacementError:  # the fill left the memory too fragmented: base copies first
            for key in list(ledger.tier):
                ledger.remove(key)
            cov = CoverageState(p)
            self._base(ledger, cov, pop)
        self._fill(ledger, cov)
        retier_by_popularity(ledger)

    # -- step 1 and 3: coverage per byte -------------------------------------------------------
    def _missing(self, ledger: Ledger) -> int:
        p = ledger.p
        return sum(1 for layer in range(p.layers) for e in range(p.experts)
                   if ledger.fp16_count(layer, e) == 0)

    def _gpu_slots(self, ledger: Ledger) -> int:
        """fp16 experts the nodes' GPU tiers can still take."""
        b = ledger.size[FULL_PRECISION]
        return sum(max(0, ledger.gpu_room(n)) // b for n in range(ledger.p.nodes))

    def _fill(self, ledger: Ledger, cov: CoverageState) -> None:
        p = ledger.p
        b16 = ledger.size[FULL_PRECISION]
        heap = [(-cov.gain(n, layer, x, v) / ledger.size[v], n, layer, x, v)
                for n in range(p.nodes) for layer in range(p.layers)
                for x in range(p.experts) for v in p.variants]
        heap = [c for c in heap if c[0] < 0]
        heapq.heapify(heap)
        missing = self._missing(ledger)
        slots = self._gpu_slots(ledger)
        while heap:
            _, n, layer, x, v = heapq.heappop(heap)
            gain = cov.gain(n, layer, x, v) / ledger.size[v]
            if gain <= 0:
                continue
            if heap and gain < -heap[0][0]:
                heapq.heappush(heap, (-gain, n, layer, x, v))
                continue
            size = ledger.size[v]
            if ledger.has(n, layer, x, v) or not ledger.fits(n, v, "gpu") \
                    or ledger.total + size + missing * b16 > p.budget_bytes:
                continue
            after = slots - ledger.gpu_room(n) // b16 + (ledger.gpu_room(n) - size) // b16
            if after < min(missing, slots):
                continue  # would leave no GPU room for the fp16 copies still owed
            ledger.add((n, layer, x, v), "gpu")
            cov.add(n, layer, x, v)
            slots = after

    # -- step 2: one fp16 copy of every expert -------------------------------------------------
    def _base(self, ledger: Ledger, cov: CoverageState, pop: np.ndarray) -> None:
        p = ledger.p
        order = sorted(((layer, e) for layer in range(p.layers) for e in range(p.experts)),
                       key=lambda le: (-pop[le], le))
        for layer, e in order:
            if ledger.fp16_count(layer, e) == 0 and not self._upgrade(ledger, cov, layer, e):
                self._first_copy(ledger, cov, layer, e)

    def _upgrade(self, ledger: Ledger, cov: CoverageState, layer: int, e: int) -> bool:
        p = ledger.p
        held = [(n, v) for n in range(p.nodes) for v in p.variants
                if v != FULL_PRECISION and ledger.has(n, layer, e, v)
                and ledger.tier[(n, layer, e, v)] == "gpu"]
        for n, v in sorted(held, key=lambda nv: (-cov.demand[nv[0], layer, e], nv)):
            ledger.remove((n, layer, e, v))
            if ledger.fits(n, FULL_PRECISION, "gpu"):
                ledger.add((n, layer, e, FULL_PRECISION), "gpu")
                cov.add(n, layer, e, FULL_PRECISION)
                return True
            ledger.add((n, layer, e, v), "gpu")
        return False

    def _first_copy(self, ledger: Ledger, cov: CoverageState, layer: int, e: int) -> None:
        p = ledger.p
        gpu = [n for n in range(p.nodes) if ledger.fits(n, FULL_PRECISION, "gpu")]
        tier = "gpu"
        if not gpu:
            gpu = [n for n in range(p.nodes) if ledger.fits(n, FULL_PRECISION, "cpu")]
            tier = "cpu"
        if not gpu:
            raise PlacementError(f"no node has room for expert {e} of layer {layer} "
                                 f"(fp16, {p.bytes_of('fp16') / 1e9:.6g} GB) after "
                                 f"{len(ledger.tier)} replicas: the memory is too fragmented")
        group = self._groups[layer][self._group_of[(layer, e)]]

        def members(n: int) -> int:
            return sum(1 for j in group if any(ledger.has(n, layer, j, v) for v in p.variants))

        n = min(gpu, key=lambda n: (-cov.gain(n, layer, e, FULL_PRECISION), members(n),
                                    -ledger.gpu_room(n), n))
        ledger.add((n, layer, e, FULL_PRECISION), tier)
        cov.add(n, layer, e, FULL_PRECISION)

    def notes(self, problem: PlacementProblem, ledger: Ledger) -> dict[str, Any]:
        groups = getattr(self, "_groups", None)
        if groups is None:
            return {}
        return {"groups": sum(len(g) for g in groups)}
