"""EdgeShard-like layer sharding (HetRoute's weakest baseline): each node holds whole layers.

The nodes, largest GPU first, take contiguous runs of layers sized to their GPU memory (a node
with twice the memory takes about twice the layers); all experts of a node's layers go there,
the most used in the GPU tier, the rest in the CPU tier. A layer that does not fit its node
spills, expert by expert in order, to the next node with room. One fp16 replica per expert:
dense partitioning keeps no copies, whatever the redundancy budget.
"""

from __future__ import annotations

import math
import random

from moe.vocab import FULL_PRECISION

from .base import Ledger, Policy, retier_by_popularity
from .problem import PlacementError

__all__ = ["LayerShardPlacement", "layer_quota"]


def layer_quota(gpu_bytes: list[int], layers: int) -> list[int]:
    """Layers per node (in the given order) in proportion to GPU memory, summing to `layers`."""
    total = sum(gpu_bytes)
    share = [layers * g / total for g in gpu_bytes]
    out = [math.floor(s) for s in share]
    rest = sorted(range(len(share)), key=lambda i: (-(share[i] - out[i]), i))
    for i in rest[: layers - sum(out)]:
        out[i] += 1
    return out


class LayerShardPlacement(Policy):
    name = "layer-shard"

    def build(self, ledger: Ledger, rng: random.Random) -> None:
        problem = ledger.p
        order = sorted(range(problem.nodes), key=lambda n: (-problem.gpu_bytes[n], n))
        quota = layer_quota([problem.gpu_bytes[n] for n in order], problem.layers)
        owner = [n for n, q in zip(order, quota, strict=True) for _ in range(q)]
        pop = problem.popularity()
        for layer, home in enumerate(owner):
            start = order.index(home)
            for e in sorted(range(problem.experts), key=lambda e: (-pop[layer, e], e)):
                for n in order[start:] + order[:start]:
                    tier = ledger.best_tier(n, FULL_PRECISION)
                    if tier is not None:
                        ledger.add((n, layer, e, FULL_PRECISION), tier)
                        break
                else:
                    raise PlacementError(f"no node has room for expert {e} of layer {layer} "
                                         f"after {len(ledger.tier)} replicas")
        retier_by_popularity(ledger)
