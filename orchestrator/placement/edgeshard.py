"""EdgeShard as its paper runs it: the model cut into pipeline stages by dynamic programming.

EdgeShard (arXiv 2405.14371) partitions a model's layers over edge devices by dynamic
programming on compute and links, and runs a token through the stages in turn: the
activations go from stage to stage, never back home between layers. Here a stage holds whole
MoE layers (their dense part and every expert, fp16), and the router moves the dense part with
the token (`dense: pipeline`, router.pipeline).

**The search** (`pipeline_path`): per layer a node, minimising one decode token's time from a
typical home and back: entry hop (home → first stage, weighted by the workload's home shares),
per layer the dense part and the top-k experts on the stage's device (the roofline of FLOPs and
one read of each expert's weights; a layer beyond what the stage's GPU holds pays the
host-to-device copy of its k experts), a hop (one activation row) wherever the stage changes,
and the exit hop back home. The state is (node, layers already on it in this run); a node's
run is at most the layers its free memory holds, and a path never enters a node it left.

**Same memory as the other arms**: the scenario's redundancy buys floor(redundancy) whole
copies of the model, each its own pipeline (searched in turn on the memory the earlier ones
left, a layer never twice on one node); the router sends each request down the pipeline that
is quickest from its home. At redundancy 2.0 EdgeShard holds 2x one fp16 copy, as HetRoute does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from moe.vocab import FULL_PRECISION

from .base import Ledger, Policy, retier_by_popularity
from .problem import PlacementError, PlacementProblem

__all__ = ["EdgeShardPlacement", "StageCosts", "pipeline_path", "stage_runs"]


def stage_runs(stages: Sequence[str]) -> list[str]:
    """A pipeline in words: edge5 edge5 edge7 → ["edge5 (0-1)", "edge7 (2)"]."""
    out: list[str] = []
    start = 0
    for i in range(1, len(stages) + 1):
        if i == len(stages) or stages[i] != stages[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{stages[start]} ({span})")
            start = i
    return out


class StageCosts:
    """The search's prices, ms of scenario time for one decode token (module docstring)."""

    def __init__(self, problem: PlacementProblem) -> None:
        p = problem
        est = p.estimates
        nodes = [est.node(name) for name in p.names]
        row = p.shape.row_bytes
        eb = p.bytes_of(FULL_PRECISION)
        self.gpu_ms = np.empty(p.nodes)
        self.cpu_ms = np.empty(p.nodes)
        for i, nd in enumerate(nodes):
            expert = p.shape.expert_flops / nd.flops_per_s
            if nd.mem_bytes_per_s is not None:
                expert = max(expert, eb / nd.mem_bytes_per_s)
            base = p.dense_flops / nd.flops_per_s + p.top_k * expert
            self.gpu_ms[i] = 1e3 * base
            self.cpu_ms[i] = 1e3 * (base + p.top_k * eb / nd.h2d_bytes_per_s)
        self.hop_ms = np.zeros((p.nodes, p.nodes))
        for a, na in enumerate(p.names):
            for b, nb in enumerate(p.names):
                link = est.links.get((na, nb))
                if a != b and link is not None:
                    self.hop_ms[a, b] = link.tx_ms(row)
        shares = np.asarray(p.home_shares, dtype=float)
        shares = shares / shares.sum()
        self.entry_ms = shares @ self.hop_ms  # from the homes to each node
        self.exit_ms = self.hop_ms @ shares  # from each node back to the homes

    def layer_ms(self, n: int, run: int, gpu_layers: int) -> float:
        """The `run`-th layer in a row on node n (1-based): GPU-resident while its GPU holds."""
        return float(self.gpu_ms[n] if run <= gpu_layers else self.cpu_ms[n])


def pipeline_path(costs: StageCosts, layers: int, capacity: list[int], gpu_layers: list[int],
                  allowed: np.ndarray | None = None) -> tuple[list[int], float]:
    """The cheapest node per layer (module docstring): `capacity[n]` layers at most on node n,
    the first `gpu_layers[n]` of them GPU-resident; `allowed[l, n]` False keeps layer l off n.
    Returns (nodes per layer, predicted ms); PlacementError when no path exists.

    Dynamic programming over (node, layers in the current run), keeping the cheapest path per
    state; a path never enters a node it left (its runs would share one memory), which makes
    the search a heuristic where it would otherwise be exact."""
    nodes = len(capacity)
    allowed = np.ones((layers, nodes), bool) if allowed is None else allowed
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
    for n in range(nodes):
        if capacity[n] >= 1 and allowed[0, n]:
            best[(n, 1)] = (float(costs.entry_ms[n]) + costs.layer_ms(n, 1, gpu_layers[n]),
                            (n,))
    for layer in range(1, layers):
        nxt: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        for (m, run), (ms, path) in sorted(best.items()):
            options = []
            if run + 1 <= capacity[m] and allowed[layer, m]:
                options.append(((m, run + 1), ms + costs.layer_ms(m, run + 1, gpu_layers[m]), m))
            for n in range(nodes):
                if n != m and n not in path and capacity[n] >= 1 and allowed[layer, n]:
                    options.append(((n, 1), ms + float(costs.hop_ms[m, n])
                                    + costs.layer_ms(n, 1, gpu_layers[n]), n))
            for key, value, n in options:
                if value < nxt.get(key, (math.inf,))[0]:
                    nxt[key] = (value, (*path, n))
        best = nxt
    if not best:
        raise PlacementError("no pipeline of whole layers fits the nodes' memory")
    ms, path = min(((ms + float(costs.exit_ms[path[-1]]), path) for ms, path in best.values()),
                   key=lambda x: (x[0], x[1]))
    return list(path), ms


class EdgeShardPlacement(Policy):
    name = "edgeshard"

    def __init__(self) -> None:
        self.pipelines: list[list[str]] = []
        self.predicted_ms: list[float] = []

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        p = ledger.p
        eb = p.bytes_of(FULL_PRECISION)
        layer_bytes = p.experts * eb
        copies = max(1, math.floor(p.redundancy + 1e-9))
        costs = StageCosts(p)
        allowed = np.ones((p.layers, p.nodes), bool)
        pop = p.popularity()
        self.pipelines, self.predicted_ms = [], []
        for copy in range(copies):
            gpu_free = [max(0, ledger.gpu_room(n)) for n in range(p.nodes)]
            cpu_free = [p.cpu_bytes[n] - ledger.cpu_used[n] for n in range(p.nodes)]
            gpu_layers = [g // layer_bytes for g in gpu_free]
            # the CPU tier computes on the GPU after a copy: no GPU room for one, no CPU tier
            capacity = [0 if p.gpu_bytes[n] - ledger.gpu_used[n] < eb
                        else (gpu_free[n] // eb + cpu_free[n] // eb) // p.experts
                        for n in range(p.nodes)]
            try:
                path, ms = pipeline_path(costs, p.layers, capacity, gpu_layers, allowed)
            except PlacementError:
                if copy == 0:
                    raise PlacementError(
                        f"no node order holds whole layers of {layer_bytes} bytes (a layer's "
                        f"{p.experts} fp16 experts): EdgeShard needs every layer on one node"
                    ) from None
                break  # the memory left holds no further whole copy
            for layer, n in enumerate(path):
                for e in sorted(range(p.experts), key=lambda e: (-pop[layer, e], e)):
                    tier = ledger.best_tier(n, FULL_PRECISION)
                    if tier is None:
                        raise PlacementError(f"layer {layer} does not fit {p.names[n]} "
                                             f"after {len(ledger.tier)} replicas")
                    ledger.add((n, layer, e, FULL_PRECISION), tier)
                allowed[layer, n] = False
            self.pipelines.append([p.names[n] for n in path])
            self.predicted_ms.append(round(ms, 4))
        retier_by_popularity(ledger)

    def notes(self, problem: PlacementProblem, ledger: Ledger) -> dict[str, Any]:
        return {"pipelines": [list(x) for x in self.pipelines],
                "pipeline_predicted_ms": list(self.predicted_ms)}
