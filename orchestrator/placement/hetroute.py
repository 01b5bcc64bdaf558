"""HetRoute's offline stage: replicas, precisions and GPU residency by routing cost.

Costs are the router's own (`router.cost` per use, through `orchestrator.placement.evaluate`).

1. One fp16 replica of every expert, most used first, where Σ demand x cost (plus, from the
   second pass on, the price of the memory it takes) is least.
2. Extra replicas, on other nodes or in low precision (int8/int4 when the scenario allows), and
   moves of CPU-tier replicas up to the GPU tier, added greedily by cost reduction per byte
   while the reduction beats the memory price (`memory_price_ms_per_gb`, 0 by default) and
   the redundancy budget has room. Gains only shrink as replicas are added (the cheapest
   replica can only get cheaper), so a lazy heap picks what an exhaustive rescan would.
   Steps 1-2 run `price_passes` times: each pass prices every node's GPU and CPU memory by
   the best gain per byte that memory turned away, so the next pass's first copies leave
   scarce GPU memory to what gains more there. The cheapest pass stays.
2b. A bounded local search (`max_moves` trials): merge an expert's only fp16 copy into the
   node holding a low-precision copy of it (one copy then serves both purposes), drop
   replicas, move first copies; the greedy refills what a move freed; better moves stay.
3. The router is simulated on the calibration traffic: replicas it never chooses are dropped
   (never an expert's last fp16 one) and the freed memory goes through step 2 again, without
   them; then GPU residency is re-optimised per node by (probability that the router selects
   the replica) x (load time the GPU tier saves it), per byte.
"""

from __future__ import annotations

import heapq
import random
from typing import Any

import numpy as np

from moe.vocab import FULL_PRECISION, TIERS

from .base import Key, Ledger, Policy, need_one_copy, retier
from .evaluate import CostTables, cost_tables, simulate
from .problem import PlacementError, PlacementProblem

__all__ = ["HetRoutePlacement"]

EPS_MS = 1e-9


class HetRoutePlacement(Policy):
    name = "hetroute"
    follows_router = True
    rounds = 2  # simulate → drop unused → refill, this many times, then a final residency pass
    memory_price_ms_per_gb = 0.0
    max_moves = 64  # trials of the local search (step 2b)
    price_passes = 4  # steps 1-2 with memory priced by the previous pass

    def place(self, problem: PlacementProblem, rng: random.Random) -> Ledger:
        need_one_copy(problem)
        tables = cost_tables(problem)
        self._stats: dict[str, Any] = {"dropped": 0, "rounds": self.rounds}
        banned: set[Key] = set()
        ledger = self._priced(problem, tables)
        if self.max_moves:
            ledger = self._improve(ledger, tables, banned)
        for _ in range(self.rounds):
            sim = self._selections(ledger)
            dropped = self._drop_unused(ledger, sim)
            banned |= dropped
            self._stats["dropped"] += len(dropped)
            retier(ledger, self._benefit(problem, sim))
            if dropped:
                self._fill(ledger, tables, banned)
        retier(ledger, self._benefit(problem, self._selections(ledger)))
        return ledger

    def notes(self, problem: PlacementProblem, ledger: Ledger) -> dict[str, Any]:
        quantized = sum(1 for k in ledger.tier if k[3] != FULL_PRECISION)
        return {**getattr(self, "_stats", {}), "quantized_replicas": quantized}

    # -- steps 1 and 2, priced -----------------------------------------------------------
    def _priced(self, problem: PlacementProblem, tables: CostTables) -> Ledger:
        """Steps 1-2 a few times: each pass prices every node's GPU and CPU memory by what
        the refill could not put there (the best gain per byte memory turned away), and the
        next pass's first copies pay that price, so they leave scarce GPU memory to what
        gains more there. The cheapest pass (separable cost) wins."""
        price: np.ndarray | None = None
        best: tuple[float, Ledger] | None = None
        for _ in range(self.price_passes):
            self._price = np.zeros((problem.nodes, len(TIERS)))
            ledger = Ledger(problem)
            self._base(ledger, tables, price)
            self._fill(ledger, tables, set())
            cost = self._separable(ledger, tables)
            if best is None or cost < best[0] * (1 - 1e-9):
                best = (cost, ledger)
            price = self._price if price is None else (price + self._price) / 2
        assert best is not None
        return best[1]

    # -- step 1 ---------------------------------------------------------------------------
    def _base(self, ledger: Ledger, tables: CostTables,
              price: np.ndarray | None = None) -> None:
        """One fp16 copy per expert, most used first, where Σ demand x cost + the memory's
        price (ms per byte, per node and tier; from the previous pass) is least."""
        p = ledger.p
        fp = tables.variants.index(FULL_PRECISION)
        use = tables.demand.sum(axis=0)
        order = sorted(((layer, e) for layer in range(p.layers) for e in range(p.experts)),
                       key=lambda le: (-use[le], le))
        for layer, e in order:
            cost = tables.cost(layer, e)[:, :, fp, :]  # [h, n, t]
            w = tables.demand[:, layer, e]
            score = np.einsum("h,hnt->nt", w, cost) if w.any() else cost.mean(axis=0)
            if price is not None:
                score = score + price * p.bytes_of(FULL_PRECISION)
            best: tuple[float, int, str] | None = None
            for n in range(p.nodes):
                for ti, tier in enumerate(TIERS):
                    if ledger.fits(n, FULL_PRECISION, tier) and (best is None
                                                                 or score[n, ti] < best[0]):
                        best = (float(score[n, ti]), n, tier)
            if best is None:
                raise PlacementError(
                    f"no node has room for expert {e} of layer {layer} (fp16, "
                    f"{p.bytes_of('fp16') / 1e9:.6g} GB) after {len(ledger.tier)} replicas")
            ledger.add((best[1], layer, e, FULL_PRECISION), best[2])

    # -- step 2 ---------------------------------------------------------------------------
    def _fill(self, ledger: Ledger, tables: CostTables, banned: set[Key]) -> None:
        """Lazy greedy: add the replica with the largest cost reduction per byte."""
        p = ledger.p
        variants = tables.variants
        size = np.array([p.bytes_of(v) for v in variants], dtype=float)
        price = self.memory_price_ms_per_gb / 1e9
        if not hasattr(self, "_price"):
            self._price = np.zeros((p.nodes, len(TIERS)))
        best = self._best(ledger, tables)
        heap: list[tuple[float, int, int, int, int, int]] = []
        for layer in range(p.layers):
            for e in range(p.experts):
                self._push(heap, ledger, tables, best, banned, layer, e, size)
        heapq.heapify(heap)
        while heap:
            neg, layer, e, n, vi, ti = heapq.heappop(heap)
            gain_per_byte = -neg
            if gain_per_byte <= price or gain_per_byte * size[vi] <= EPS_MS:
                break
            key = (n, layer, e, variants[vi])
            held = ledger.tier.get(key)  # None, or "cpu" for an upgrade to the GPU tier
            if held == TIERS[ti]:
                continue
            if held is not None:
                ledger.remove(key)
            if not ledger.fits(n, variants[vi], TIERS[ti]):
                if held is not None:
                    ledger.add(key, held, exact=True)
                if ledger.total + (0 if held else size[vi]) <= p.budget_bytes:
                    # memory, not the budget, turned it away: what memory there is worth
                    self._price[n, ti] = max(self._price[n, ti], gain_per_byte)
                continue  # memory only shrinks here: it will not fit later either
            fresh = self._gain(tables, best, layer, e)[n, vi, ti] / size[vi]
            if fresh < gain_per_byte * (1 - 1e-9):  # stale: a replica of it came since
                if held is not None:
                    ledger.add(key, held, exact=True)
                heapq.heappush(heap, (-fresh, layer, e, n, vi, ti))
                continue
            ledger.add(key, TIERS[ti])
            cost = tables.cost(layer, e)[:, n, vi, ti]
            best[:, layer, e] = np.minimum(best[:, layer, e], cost)

    def _push(self, heap: list, ledger: Ledger, tables: CostTables, best: np.ndarray,
              banned: set[Key], layer: int, e: int, size: np.ndarray) -> None:
        gain = self._gain(tables, best, layer, e)  # [n, v, t]
        for n, vi, ti in zip(*np.nonzero(gain > EPS_MS), strict=True):
            key = (int(n), layer, e, tables.variants[vi])
            held = ledger.tier.get(key)
            if key in banned or (held is not None and (held, TIERS[ti]) != ("cpu", "gpu")):
                continue  # new replicas, and CPU-tier ones moving up to the GPU tier
            heap.append((-float(gain[n, vi, ti] / size[vi]), layer, e, int(n), int(vi), int(ti)))

    @staticmethod
    def _gain(tables: CostTables, best: np.ndarray, layer: int, e: int) -> np.ndarray:
        """[n, v, t]: demand-weighted cost reduction of adding each replica of this expert."""
        cost = tables.cost(layer, e)  # [h, n, v, t]
        cut = np.maximum(best[:, layer, e][:, None, None, None] - cost, 0.0)
        return np.einsum("h,hnvt->nvt", tables.demand[:, layer, e], cut)

    @staticmethod
    def _best(ledger: Ledger, tables: CostTables) -> np.ndarray:
        """[h, l, e]: the cheapest held replica's cost per use, for each home."""
        p = ledger.p
        best = np.full((p.nodes, p.layers, p.experts), np.inf)
        for (n, layer, e, v), tier in ledger.tier.items():
            cost = tables.cost(layer, e)[:, n, tables.variants.index(v), TIERS.index(tier)]
            best[:, layer, e] = np.minimum(best[:, layer, e], cost)
        return best

    # -- step 2b --------------------------------------------------------------------------
    def _improve(self, ledger: Ledger, tables: CostTables, banned: set[Key]) -> Ledger:
        """Local search (step 2b): a move takes replicas out, the greedy refills what they
        freed (never putting them back), and it stays when the separable cost fell. Moves,
        at most `max_moves`, in this order:
        - merge: an expert's only fp16 copy moves onto a node that holds a low-precision
          copy of it, which it replaces (one copy serves both as the node's local copy and
          as the full-precision fallback, and the freed bytes go elsewhere);
        - drop: one replica (not an expert's last fp16 one), least loss per byte first;
        - move: an expert's only fp16 copy in a GPU tier goes to its next best spot.
        """
        p = ledger.p
        cost = self._separable(ledger, tables)
        loss = self._removal_loss(ledger, tables)
        moves: list[tuple[Key, ...]] = []
        fp16_of: dict[tuple[int, int], list[Key]] = {}
        for key in ledger.tier:
            if key[3] == FULL_PRECISION:
                fp16_of.setdefault(key[1:3], []).append(key)
        lower = sorted((k for k in ledger.tier if k[3] != FULL_PRECISION),
                       key=lambda k: (-loss.get(k, 0.0), k))  # the most useful copies first
        for k in lower:
            sole = fp16_of.get(k[1:3], [])
            if len(sole) == 1:
                moves.append(("merge", sole[0], k))
        drops = sorted((k for k in ledger.tier if not (k[3] == FULL_PRECISION
                                                        and len(fp16_of[k[1:3]]) == 1)),
                       key=lambda k: (loss.get(k, 0.0) / ledger.size[k[3]], k))
        moves += [("drop", k) for k in drops]
        moves += [("move", k) for k in sorted(ledger.tier) if k[3] == FULL_PRECISION
                  and ledger.tier[k] == "gpu" and len(fp16_of[k[1:3]]) == 1]
        done = 0
        for move in moves[: self.max_moves]:
            keys = move[1:]
            if any(k not in ledger.tier for k in keys):
                continue
            trial = Ledger.of(p, ledger.replicas())
            if move[0] == "merge":
                fp, low = keys
                tier = trial.tier[low]
                trial.remove(fp)
                trial.remove(low)
                target = (low[0], low[1], low[2], FULL_PRECISION)
                if target in trial.tier or not trial.fits(low[0], FULL_PRECISION, tier, exact=True):
                    continue
                trial.add(target, tier, exact=True)
            else:
                trial.remove(keys[0])
                _, layer, e, _ = keys[0]
                if trial.fp16_count(layer, e) == 0 and (
                        move[0] == "drop" or not self._relocate(trial, tables, keys[0])):
                    continue  # the expert's last fp16 copy stays (or moves, never goes)
            self._fill(trial, tables, banned | set(keys))
            new = self._separable(trial, tables)
            if new < cost * (1 - 1e-9):
                ledger, cost = trial, new
                done += 1
        self._stats["moves"] = done
        return ledger

    @staticmethod
    def _relocate(ledger: Ledger, tables: CostTables, key: Key) -> bool:
        """Put the expert's fp16 copy on its cheapest other (node, tier) with room."""
        n0, layer, e, _ = key
        fp = tables.variants.index(FULL_PRECISION)
        score = np.einsum("h,hnt->nt", tables.demand[:, layer, e],
                          tables.cost(layer, e)[:, :, fp, :])
        spots = sorted((float(score[n, ti]), n, tier) for n in range(ledger.p.nodes)
                       for ti, tier in enumerate(TIERS) if n != n0)
        for _, n, tier in spots:
            if not ledger.has(n, layer, e, FULL_PRECISION) and ledger.fits(n, FULL_PRECISION, tier):
                ledger.add((n, layer, e, FULL_PRECISION), tier)
                return True
        return False

    def _separable(self, ledger: Ledger, tables: CostTables) -> float:
        best = self._best(ledger, tables)
        return float(np.einsum("hle,hle->", tables.demand, np.where(np.isfinite(best), best,
                                                                     0.0)))

    @staticmethod
    def _removal_loss(ledger: Ledger, tables: CostTables) -> dict[Key, float]:
        """How much the separable cost rises if each replica alone were taken out."""
        by_expert: dict[tuple[int, int], list[tuple[Key, np.ndarray]]] = {}
        for key, tier in ledger.tier.items():
            n, layer, e, v = key
            cost = tables.cost(layer, e)[:, n, tables.variants.index(v), TIERS.index(tier)]
            by_expert.setdefault((layer, e), []).append((key, cost))
        out = {}
        for (layer, e), held in by_expert.items():
            costs = np.stack([c for _, c in held])  # [replicas, h]
            demand = tables.demand[:, layer, e]
            for i, (key, _) in enumerate(held):
                rest = np.delete(costs, i, axis=0)
                if not len(rest):
                    out[key] = float("inf")
                    continue
                out[key] = float(demand @ (rest.min(axis=0) - costs.min(axis=0)))
        return out

    # -- step 3 ---------------------------------------------------------------------------
    @staticmethod
    def _selections(ledger: Ledger) -> dict[Key, float]:
        """Router picks per calibration token of each replica, keyed by (node, l, e, v)."""
        p = ledger.p
        index = {name: i for i, name in enumerate(p.names)}
        sim = simulate(p, ledger.replicas(), p.router)
        return {(index[r.node], r.layer, r.expert, r.variant): share
                for r, share in sim.selections.items()}

    @staticmethod
    def _drop_unused(ledger: Ledger, picks: dict[Key, float]) -> set[Key]:
        dropped = set()
        for key in sorted(ledger.tier):
            if picks.get(key, 0.0) > 0:
                continue
            _, layer, e, v = key
            if v == FULL_PRECISION and ledger.fp16_count(layer, e) <= 1:
                continue
            ledger.remove(key)
            dropped.add(key)
        return dropped

    @staticmethod
    def _benefit(problem: PlacementProblem, picks: dict[Key, float]) -> Any:
        h2d = [problem.estimates.node(name).h2d_bytes_per_s for name in problem.names]
        pop = problem.popularity()

        def benefit(key: Key) -> float:
            n, layer, e, v = key
            load_ms = 1e3 * problem.bytes_of(v) / h2d[n]
            # popularity only breaks ties among replicas the router never chose
            return (picks.get(key, 0.0) + 1e-6 * float(pop[layer, e])) * load_ms

        return benefit
