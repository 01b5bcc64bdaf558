"""Prism's activation-aware placement (arXiv 2508.12851; HetRoute's strongest baseline).

What the paper's public summaries say, in our words: Prism places experts on heterogeneous GPU
edge servers so as to cut remote expert invocations, the proxy objective
`Σ_servers Σ_layers Σ_experts f_n^l(e) · [e not on n]` where f_n^l(e) is how often requests
homed at server n activate expert e of layer l, under each server's GPU memory. It works in two
stages, then adapts at run time:

1. *Layer-wise expert counts.* Each server's share of the memory (its slots) is split among
   the layers by the diversity of its own activations there: in proportion to exp(entropy of
   f_n^l), the effective number of experts that layer uses, at most all of them. A layer
   spread over many experts needs more copies to stay local than one dominated by a few.
2. *Expert-to-server assignment*, greedy and coverage-guaranteeing: each server takes, per
   layer, the experts its requests activate most; every expert held nowhere then replaces the
   least used duplicated expert of that layer on the server that activates it most (or takes
   free room), so each is held at least once.
3. *Runtime migration* re-runs the two stages on recent activation counts and moves experts
   when the invocations saved over a horizon outweigh the copy (`plan_migration`).

Our choices where the summaries are silent: the slots are the redundancy budget in fp16
experts (Prism keeps full-precision experts only), shared among the servers in proportion to
their requests and capped by each server's GPU memory (GPU first; leftovers go to servers
with GPU room, by requests); a server's memory holds its slots in the GPU tier; the CPU tier
only when the GPU tiers cannot hold one copy of the model.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from moe.vocab import FULL_PRECISION
from router.types import Replica

from .base import Ledger, Policy, retier_by_popularity, spread_base
from .problem import PlacementProblem

__all__ = ["Migration", "PrismPlacement", "layer_counts", "plan_migration", "server_slots"]


def layer_counts(freq: np.ndarray, slots: int) -> list[int]:
    """Split one server's `slots` among layers in proportion to exp(entropy) of its
    activations per layer (`freq` [layers, experts]), at most `experts` per layer."""
    layers, experts = freq.shape
    slots = min(slots, layers * experts)
    total = freq.sum(axis=1, keepdims=True)
    p = np.divide(freq, total, out=np.full_like(freq, 1.0 / experts), where=total > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    weight = np.exp(ent)
    out = [0] * layers
    left = slots
    while left > 0:  # proportional shares, capped; what a capped layer cannot take moves on
        open_ = [i for i in range(layers) if out[i] < experts]
        w = sum(weight[i] for i in open_)
        share = {i: left * weight[i] / w for i in open_}
        give = {i: min(experts - out[i], math.floor(share[i])) for i in open_}
        if not any(give.values()):
            best = max(open_, key=lambda i: (share[i] - math.floor(share[i]), -i))
            give = {best: 1}
        for i, g in give.items():
            out[i] += g
            left -= g
    return out


def server_slots(shares: list[float], caps: list[int], slots: int) -> list[int]:
    """Water-fill `slots` over servers in proportion to `shares`, each at most its cap; what
    the shares cannot place goes to servers with room left, most requests first."""
    out = [0] * len(caps)
    left = min(slots, sum(caps))
    while left > 0:
        open_ = [i for i in range(len(caps)) if out[i] < caps[i]]
        w = sum(shares[i] for i in open_)
        if w <= 0:
            for i in sorted(open_, key=lambda i: (-(caps[i] - out[i]), i)):
                g = min(caps[i] - out[i], left)
                out[i] += g
                left -= g
            break
        give = {i: min(caps[i] - out[i], math.floor(left * shares[i] / w)) for i in open_}
        if not any(give.values()):
            give = {max(open_, key=lambda i: (shares[i], -i)): 1}
        for i, g in give.items():
            out[i] += g
            left -= g
    return out


def assign(freq: np.ndarray, counts: list[list[int]], spare: list[int]
           ) -> list[set[tuple[int, int]]]:
    """Stage 2: per server the (layer, expert) pairs it holds; every expert at least once
    (a duplicate of its layer gives way, or a server's `spare` slots take it)."""
    nodes, layers, experts = freq.shape
    pop = freq.sum(axis=0)
    held: list[set[tuple[int, int]]] = [set() for _ in range(nodes)]
    for n in range(nodes):
        for layer in range(layers):
            ranked = sorted(range(experts), key=lambda e: (-freq[n, layer, e], -pop[layer, e], e))
            held[n].update((layer, e) for e in ranked[: counts[n][layer]])
    copies = {(layer, e): sum((layer, e) in h for h in held)
              for layer in range(layers) for e in range(experts)}
    for (layer, e), c in sorted(copies.items(), key=lambda kv: (-pop[kv[0]], kv[0])):
        if c:
            continue
        best: tuple[float, int, tuple[int, int]] | None = None
        for n in sorted(range(nodes), key=lambda n: (-freq[n, layer, e], n)):
            dup = [k for k in held[n] if k[0] == layer and copies[k] > 1]
            if dup:
                victim = min(dup, key=lambda k: (freq[n][k], k))
                loss = freq[n][victim] - freq[n, layer, e]
                if best is None or loss < best[0]:
                    best = (loss, n, victim)
        if best is None:
            room = [n for n in range(nodes) if spare[n] > 0]
            if not room:
                continue  # memory too tight for the counts: the ledger places it (build)
            n = max(room, key=lambda n: (freq[n, layer, e], spare[n], -n))
            spare[n] -= 1
        else:
            _, n, victim = best
            held[n].discard(victim)
            copies[victim] -= 1
        held[n].add((layer, e))
        copies[(layer, e)] = 1
    return held


def prism_sets(problem: PlacementProblem, freq: np.ndarray, ledger: Ledger,
               copies: str = FULL_PRECISION) -> list[set[tuple[int, int]]]:
    """Stages 1 and 2 for activation counts `freq` [nodes, layers, experts]; `copies`: the
    precision of the copies beyond each expert's one fp16 copy (slots and caps in its size)."""
    b16 = ledger.size[FULL_PRECISION]
    unit = ledger.size[copies]
    caps = [max(0, ledger.gpu_room(n)) // unit for n in range(problem.nodes)]
    whole = problem.layers * problem.experts
    if sum(caps) < whole:  # the GPU tiers cannot hold the model once: count the CPU tiers
        caps = [0 if g < b16 else max(g // unit, (g - b16) // unit + c // b16)
                for g, c in zip(problem.gpu_bytes, problem.cpu_bytes, strict=True)]
    caps = [min(c, whole) for c in caps]
    slots = max(whole, whole + (problem.budget_bytes - whole * b16) // unit)
    shares = [float(freq[n].sum()) for n in range(problem.nodes)]
    per_server = server_slots(shares, caps, slots)
    counts = [layer_counts(freq[n], per_server[n]) for n in range(problem.nodes)]
    spare = [caps[n] - sum(counts[n]) for n in range(problem.nodes)]
    return assign(freq, counts, spare)


class PrismPlacement(Policy):
    name = "prism"

    def copies(self, problem: PlacementProblem) -> str:
        """The precision of the copies beyond each expert's one fp16 copy: fp16, as Prism
        keeps full-precision experts only."""
        return FULL_PRECISION

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        """First one copy of each expert on its most active planned holder with GPU room (any
        node with room when the memory is too tight for the plan), then the plan's other
        copies where the GPU tier has room."""
        p = ledger.p
        freq = p.demand()
        extra = self.copies(p)
        sets = prism_sets(p, freq, ledger, extra)
        order = sorted(((layer, e) for layer in range(p.layers) for e in range(p.experts)),
                       key=lambda le: (-p.popularity()[le], le))

        def choose(layer: int, e: int, fitting: list[int]) -> int:
            gpu = [n for n in fitting if ledger.fits(n, FULL_PRECISION, "gpu")]  # GPU tier first
            pool = gpu or fitting
            planned = [n for n in pool if (layer, e) in sets[n]] or pool
            return max(planned, key=lambda n: (freq[n, layer, e], -n))

        spread_base(ledger, order, choose)
        for layer, e in order:
            for n in range(p.nodes):
                if (layer, e) in sets[n] and not ledger.has(n, layer, e, FULL_PRECISION) \
                        and not ledger.has(n, layer, e, extra) \
                        and ledger.fits(n, extra, "gpu"):
                    ledger.add((n, layer, e, extra), "gpu")
        retier_by_popularity(ledger)


class PrismQuantPlacement(PrismPlacement):
    """Prism's stages with its extra copies in the smallest precision the placement allows
    (`variants`, e.g. int4): the same memory holds more copies, at the quality cost the
    router prices. Not in the paper: it takes quantized replication apart from routing
    (issue 39: HetRoute places int8/int4 replicas, Prism fp16 only)."""

    name = "prism-quant"

    def copies(self, problem: PlacementProblem) -> str:
        return min(problem.variants, key=problem.bytes_of)


@dataclass(frozen=True)
class Migration:
    """Experts to copy in and drop, and why (remote invocations per token, before/after)."""

    add: tuple[Replica, ...]
    drop: tuple[Replica, ...]
    remote_before: float
    remote_after: float
    worth: bool


def remote_share(freq: np.ndarray, sets: list[set[tuple[int, int]]]) -> float:
    """The proxy objective: activations per token served away from their home server."""
    return float(sum(freq[n, layer, e] for n in range(freq.shape[0])
                     for layer in range(freq.shape[1]) for e in range(freq.shape[2])
                     if (layer, e) not in sets[n]))


def plan_migration(problem: PlacementProblem, current: tuple[Replica, ...], recent: np.ndarray,
                   *, tokens_per_s: float, horizon_s: float, remote_ms: float,
                   copy_ms_per_expert: float) -> Migration:
    """Prism's runtime step: the placement for `recent` activation counts [nodes, layers,
    experts] (uses per token) and whether moving to it pays: remote invocations saved x
    `remote_ms` x tokens over `horizon_s` must exceed the copies' `copy_ms_per_expert`."""
    names = problem.names
    held = [{(r.layer, r.expert) for r in current if r.node == name} for name in names]
    target = prism_sets(problem, recent, Ledger(problem))
    add = tuple(Replica(layer, e, names[n], FULL_PRECISION, "gpu") for n in range(problem.nodes)
                for layer, e in sorted(target[n] - held[n]))
    drop = tuple(r for r in current if (r.layer, r.expert) not in target[names.index(r.node)])
    before, after = remote_share(recent, held), remote_share(recent, target)
    saved_ms = (before - after) * remote_ms * tokens_per_s * horizon_s
    return Migration(add, drop, before, after, saved_ms > copy_ms_per_expert * len(add))
