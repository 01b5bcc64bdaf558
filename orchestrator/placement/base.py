"""What every placement policy shares: memory accounting, the rules, the result.

The rules (what `check` enforces and `Ledger` never lets a policy break), the same ones the
node applies to `PUT /v1/placement` (`services.tiers`):
- per node, the GPU tier's bytes fit its GPU memory and the CPU tier's bytes its CPU memory;
- a node with CPU-tier experts leaves GPU room for the largest of them (it is computed on the
  GPU after a host-to-device copy);
- a node holds one expert in one precision once (one tier);
- all replicas together weigh at most `redundancy` x one fp16 copy of every expert;
- **every expert keeps at least one full-precision (fp16) replica** (the quality-safe
  fallback the router may always use).

A policy is a class with a `name` and `build(ledger, rng)`, which fills the empty ledger that
`Policy.place(problem, rng)` hands it; `orchestrator.placement.place` checks the ledger against
the rules and measures it (`orchestrator.placement.evaluate`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moe.vocab import FULL_PRECISION, TIERS
from router.types import Replica

from .problem import PlacementError, PlacementProblem

__all__ = ["Key", "Ledger", "PlacementResult", "Policy", "check", "need_one_copy",
           "popularity_benefit", "retier", "retier_by_popularity", "spread_base"]

Key = tuple[int, int, int, str]  # (node index, layer, expert, variant)


class Ledger:
    """A placement under construction: replicas by key, and each node's bytes per tier."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.p = problem
        self.tier: dict[Key, str] = {}
        self.gpu_used = [0] * problem.nodes
        self.cpu_used = [0] * problem.nodes
        self._cpu_sizes: list[dict[int, int]] = [{} for _ in range(problem.nodes)]
        self.total = 0
        self.size = {v: problem.bytes_of(v) for v in problem.variants}
        self._largest = max(self.size.values())

    def _cpu_max(self, n: int) -> int:
        return max(self._cpu_sizes[n], default=0)

    def fits(self, n: int, variant: str, tier: str, *, exact: bool = False) -> bool:
        """Could one more replica of this size go to this node's tier (and the budget)?

        Policies build with `exact=False`: a GPU-tier replica then also leaves room for one
        CPU-tier expert of the largest allowed size (when the node has CPU memory for it), so
        filling the GPU first never shuts the CPU tier. `check` and `retier` use the node's
        own rule (`exact=True`).
        """
        b = self.size[variant]
        if self.total + b > self.p.budget_bytes:
            return False
        gpu_cap = self.p.gpu_bytes[n]
        if tier == "gpu":
            reserve = self._cpu_max(n)
            if not exact and self.p.cpu_bytes[n] >= self._largest:
                reserve = max(reserve, self._largest)
            return self.gpu_used[n] + b + reserve <= gpu_cap
        return (self.cpu_used[n] + b <= self.p.cpu_bytes[n]
                and self.gpu_used[n] + max(self._cpu_max(n), b) <= gpu_cap)

    def gpu_room(self, n: int) -> int:
        """Bytes a policy may still put in this node's GPU tier (the reserve of `fits`)."""
        reserve = self._cpu_max(n)
        if self.p.cpu_bytes[n] >= self._largest:
            reserve = max(reserve, self._largest)
        return self.p.gpu_bytes[n] - self.gpu_used[n] - reserve

    def best_tier(self, n: int, variant: str) -> str | None:
        """GPU when it fits, else CPU when it fits, else None."""
        for tier in TIERS:
            if self.fits(n, variant, tier):
                return tier
        return None

    def has(self, n: int, layer: int, expert: int, variant: str) -> bool:
        return (n, layer, expert, variant) in self.tier

    def add(self, key: Key, tier: str, *, exact: bool = False) -> None:
        n, _, _, variant = key
        if key in self.tier:
            raise PlacementError(f"{self.describe(key)} is placed twice")
        if not self.fits(n, variant, tier, exact=exact):
            raise PlacementError(f"{self.describe(key)} does not fit the {tier} tier")
        self.tier[key] = tier
        self._count(key, tier, +1)

    def remove(self, key: Key) -> None:
        tier = self.tier.pop(key)
        self._count(key, tier, -1)

    def _count(self, key: Key, tier: str, sign: int) -> None:
        n, variant = key[0], key[3]
        b = self.size[variant]
        self.total += sign * b
        if tier == "gpu":
            self.gpu_used[n] += sign * b
        else:
            self.cpu_used[n] += sign * b
            sizes = self._cpu_sizes[n]
            sizes[b] = sizes.get(b, 0) + sign
            if sizes[b] == 0:
                del sizes[b]

    def keys_of(self, n: int) -> list[Key]:
        return [k for k in self.tier if k[0] == n]

    def fp16_count(self, layer: int, expert: int) -> int:
        return sum(1 for n in range(self.p.nodes)
                   if (n, layer, expert, FULL_PRECISION) in self.tier)

    def describe(self, key: Key) -> str:
        n, layer, expert, variant = key
        return f"expert {expert} of layer {layer} ({variant}) on {self.p.names[n]}"

    def replicas(self) -> tuple[Replica, ...]:
        names = self.p.names
        return tuple(Replica(layer, e, names[n], v, t)
                     for (n, layer, e, v), t in sorted(self.tier.items()))

    @classmethod
    def of(cls, problem: PlacementProblem, replicas: Iterable[Replica]) -> Ledger:
        """A ledger holding `replicas` (PlacementError when one breaks a rule)."""
        index = {name: i for i, name in enumerate(problem.names)}
        ledger = cls(problem)
        for r in replicas:
            if r.node not in index:
                raise PlacementError(f"replica on unknown node {r.node!r}")
            if r.variant not in ledger.size:
                raise PlacementError(f"variant {r.variant} is not allowed here "
                                     f"(variants: {', '.join(problem.variants)})")
            ledger.add((index[r.node], r.layer, r.expert, r.variant), r.tier, exact=True)
        return ledger


def check(problem: PlacementProblem, replicas: Iterable[Replica]) -> Ledger:
    """Raise PlacementError naming the first broken rule; the ledger of a valid placement."""
    reps = list(replicas)
    for r in reps:
        if not (0 <= r.layer < problem.layers and 0 <= r.expert < problem.experts):
            raise PlacementError(f"replica {r} is outside the model ({problem.layers} layers, "
                                 f"{problem.experts} experts)")
    ledger = Ledger.of(problem, reps)
    for layer in range(problem.layers):
        for e in range(problem.experts):
            if ledger.fp16_count(layer, e) == 0:
                raise PlacementError(f"expert {e} of layer {layer} has no full-precision "
                                     f"(fp16) replica")
    return ledger


def need_one_copy(problem: PlacementProblem) -> None:
    """Raise when not even one fp16 copy of every expert fits the nodes' memory."""
    b = problem.bytes_of(FULL_PRECISION)
    room = sum(0 if gpu < b else max(gpu // b, (gpu - b) // b + cpu // b)
               for gpu, cpu in zip(problem.gpu_bytes, problem.cpu_bytes, strict=True))
    need = problem.layers * problem.experts
    if room < need:
        raise PlacementError(
            f"one fp16 copy of every expert needs {need} x {b / 1e9:.6g} GB = "
            f"{need * b / 1e9:.6g} GB; the nodes hold at most {room} experts "
            f"(GPU {sum(problem.gpu_bytes) / 1e9:.6g} GB + CPU {sum(problem.cpu_bytes) / 1e9:.6g}"
            f" GB): add memory or nodes, or use a smaller model")


def retier(ledger: Ledger, benefit: Callable[[Key], float]) -> None:
    """Re-decide each node's GPU residency: highest `benefit` per byte first.

    Per node: if everything fits the GPU, all goes there; else the GPU keeps room for the
    largest replica (which may land in the CPU tier) and is filled by benefit per byte, the
    rest goes to the CPU tier. A node whose new split would not fit keeps its old one.
    """
    p = ledger.p
    for n in range(p.nodes):
        keys = ledger.keys_of(n)
        if not keys:
            continue
        size = {k: ledger.size[k[3]] for k in keys}
        old = {k: ledger.tier[k] for k in keys}
        total = sum(size.values())
        if total <= p.gpu_bytes[n]:
            new = dict.fromkeys(keys, "gpu")
        else:
            room = p.gpu_bytes[n] - max(size.values())
            new = dict.fromkeys(keys, "cpu")
            for k in sorted(keys, key=lambda k: (-benefit(k) / size[k], k)):
                if size[k] <= room:
                    new[k] = "gpu"
                    room -= size[k]
        for k in keys:
            ledger.remove(k)
        try:
            for k in sorted(keys, key=lambda k: new[k] == "cpu"):  # GPU first: reserve rule
                ledger.add(k, new[k], exact=True)
        except PlacementError:
            for k in keys:
                if k in ledger.tier:
                    ledger.remove(k)
            for k in sorted(keys, key=lambda k: old[k] == "cpu"):
                ledger.add(k, old[k], exact=True)


def retier_by_popularity(ledger: Ledger) -> None:
    """`retier` with GPU residency by how often an expert is used x how slow its copy is."""
    retier(ledger, popularity_benefit(ledger.p))


def popularity_benefit(problem: PlacementProblem) -> Callable[[Key], float]:
    """GPU residency benefit from how often the expert is used and how slow its copy is."""
    pop = problem.popularity()
    h2d = [problem.estimates.node(name).h2d_bytes_per_s for name in problem.names]

    def benefit(key: Key) -> float:
        n, layer, e, v = key
        return float(pop[layer, e]) * problem.bytes_of(v) / h2d[n]

    return benefit


@dataclass(frozen=True)
class PlacementResult:
    """A checked placement and what it is expected to cost."""

    policy: str
    problem: PlacementProblem
    replicas: tuple[Replica, ...]
    expected_cost_ms: float  # router simulated on calibration traffic, per token
    separable_cost_ms: float  # the ILP's objective (see orchestrator.placement.evaluate)
    notes: Mapping[str, Any] = field(default_factory=dict)

    def by_node(self) -> dict[str, list[dict[str, Any]]]:
        """Node → its PUT /v1/placement experts (every node listed, maybe empty)."""
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in self.problem.names}
        for r in self.replicas:
            out[r.node].append(r.entry.to_json())
        return out

    def memory(self) -> dict[str, dict[str, float]]:
        """Node → GB used and available per tier."""
        p = self.problem
        used = {n: {"gpu": 0, "cpu": 0} for n in p.names}
        for r in self.replicas:
            used[r.node][r.tier] += p.bytes_of(r.variant)
        return {name: {"gpu_used_gb": round(used[name]["gpu"] / 1e9, 9),
                       "gpu_cap_gb": round(p.gpu_bytes[i] / 1e9, 9),
                       "cpu_used_gb": round(used[name]["cpu"] / 1e9, 9),
                       "cpu_cap_gb": round(p.cpu_bytes[i] / 1e9, 9)}
                for i, name in enumerate(p.names)}

    def replica_counts(self) -> np.ndarray:
        """[layers, experts]: replicas of each expert (all precisions)."""
        out = np.zeros((self.problem.layers, self.problem.experts), dtype=int)
        for r in self.replicas:
            out[r.layer, r.expert] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        """`moemesh placement --json`: exactly policy, expected_cost_ms, local_group_coverage,
        nodes, replicas."""
        return {
            "policy": self.policy,
            "expected_cost_ms": round(self.expected_cost_ms, 6),
            "local_group_coverage": round(float(self.notes.get("local_group_coverage", 0.0)), 6),
            "nodes": self.memory(),
            "replicas": [asdict(r) for r in self.replicas],  # layer, expert, node, variant, tier
        }


class Policy:
    """One offline placement policy (one module each): `build` fills an empty ledger."""

    name: str = ""
    # whether the replicas follow the simulated router's picks (problem.router): HetRoute's
    # pruning and GPU residency do; the others place by counts and costs alone
    follows_router: bool = False

    def place(self, problem: PlacementProblem, rng: random.Random) -> Ledger:
        """A ledger that keeps every rule of this module's docstring (PlacementError, naming
        the shortfall, when not even one fp16 copy of every expert fits)."""
        need_one_copy(problem)
        ledger = Ledger(problem)
        self.build(ledger, rng)
        return ledger

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        """Add this policy's replicas to the empty `ledger` (of `ledger.p`); a policy that
        builds its own ledgers (HetRoute's passes) overrides `place` instead."""
        raise NotImplementedError(f"{type(self).__name__} overrides neither build nor place")

    def notes(self, problem: PlacementProblem, ledger: Ledger) -> dict[str, Any]:
        """Policy-specific figures for the report (OrderMoE's coverage, ...)."""
        return {}


def spread_base(ledger: Ledger, order: Iterable[tuple[int, int]],
                choose: Callable[[int, int, list[int]], int]) -> None:
    """One fp16 replica of each (layer, expert) in `order`: `choose(layer, e, fitting)` picks
    among the node indices where it fits (GPU first), PlacementError when none does."""
    p = ledger.p
    for layer, e in order:
        fitting = [n for n in range(p.nodes) if ledger.best_tier(n, FULL_PRECISION) is not None]
        if not fitting:
            need_one_copy(p)
            raise PlacementError(f"no node has room for expert {e} of layer {layer} "
                                 f"(fp16, {p.bytes_of('fp16') / 1e9:.6g} GB) after "
                                 f"{len(ledger.tier)} replicas: the memory is too fragmented")
        n = choose(layer, e, fitting)
        ledger.add((n, layer, e, FULL_PRECISION), ledger.best_tier(n, FULL_PRECISION) or "cpu")
