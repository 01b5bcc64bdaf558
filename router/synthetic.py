"""Seeded random meshes for property tests and the router benchmark.

A `SyntheticMesh` is a heterogeneous edge mesh in the spirit of HetRoute's set-up (compute
18–120 TFLOPS, host-to-device 12–64 GB/s, links 0.8–10 Gbit/s with 0.3–22 ms one-way delay),
a placement where every expert keeps one full-precision replica plus up to `replicas - 1`
more (other nodes, some quantized, some in CPU memory), random queues, and synthetic quality
tables. Nothing here is measured: it exercises the planner, it does not predict anything.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moe import profiles
from moe.vocab import FULL_PRECISION, QUANT_VARIANTS

from .cost import Estimates
from .policies.search import Option, evaluate, exhaustive, joint
from .quality import QualityTable
from .tables import PlanView
from .types import LinkEstimate, ModelShape, NodeEstimate, Placement, Replica

__all__ = ["SyntheticMesh", "beam_gaps", "random_mesh", "random_request"]

# Mixtral-8x7B's expert (moe.profiles), activations in f16 on the wire.
MIXTRAL_SHAPE = ModelShape.from_profile(profiles.get("mixtral-8x7b"), act_bytes=2)


@dataclass(frozen=True)
class SyntheticMesh:
    names: tuple[str, ...]
    home: str
    placement: Placement
    estimates: Estimates
    shape: ModelShape
    quality: QualityTable

    def view(self) -> PlanView:
        v = PlanView(self.placement, self.shape, self.quality, self.home, nodes=self.names)
        v.refresh(self.estimates)
        return v


def random_mesh(
    seed: int,
    nodes: int = 10,
    layers: int = 4,
    experts: int = 16,
    replicas: int = 4,
    *,
    quantized_share: float = 0.3,
    cpu_share: float = 0.25,
    busy_share: float = 0.2,
    shape: ModelShape = MIXTRAL_SHAPE,
) -> SyntheticMesh:
    """A mesh of `nodes` nodes; each expert has between 1 and `replicas` replicas."""
    rng = random.Random(seed)
    names = tuple(f"n{i}" for i in range(nodes))
    home = names[0]
    node_est = {}
    for name in names:
        busy = rng.random() < busy_share
        node_est[name] = NodeEstimate(
            flops_per_s=rng.uniform(18e12, 120e12),
            h2d_bytes_per_s=rng.uniform(12e9, 64e9),
            wait_ms=rng.uniform(5.0, 60.0) if busy else rng.uniform(0.0, 2.0),
            queue=rng.randint(40, 80) if busy else rng.randint(0, 4),
            capacity=64,
        )
    links = {}
    for a in names:
        for b in names:
            if a != b:
                links[(a, b)] = LinkEstimate(rng.uniform(0.3, 22.0), rng.uniform(800, 10_000))
    reps: list[Replica] = []
    for layer in range(layers):
        for e in range(experts):
            holders = rng.sample(names, min(nodes, rng.randint(1, replicas)))
            for i, node in enumerate(holders):
                variant = FULL_PRECISION
                if i > 0 and rng.random() < quantized_share:
                    variant = rng.choice(QUANT_VARIANTS)
                tier = "cpu" if rng.random() < cpu_share else "gpu"
                reps.append(Replica(layer, e, node, variant, tier))
    return SyntheticMesh(
        names=names,
        home=home,
        placement=Placement.of(reps),
        estimates=Estimates(node_est, links),
        shape=shape,
        quality=QualityTable.synthetic(layers, experts, seed),
    )


def random_request(rng: random.Random, layers: int, experts: int, top_k: int) -> tuple:
    """(layer, experts, weights): a top-k draw with softmax-like weights, heaviest first."""
    layer = rng.randrange(layers)
    chosen = rng.sample(range(experts), top_k)
    raw = sorted((rng.random() ** 2 + 0.05 for _ in chosen), reverse=True)
    total = sum(raw)
    return layer, tuple(chosen), tuple(w / total for w in raw)


def _random_option(rng: random.Random, nodes: int, var_ms: float) -> Option:
    node, var = rng.randrange(nodes), rng.uniform(0.1, var_ms)
    pen = 0.0 if rng.random() < 0.6 else rng.uniform(0, 0.01)  # most replicas are exact
    return Option(node, var, pen, 1000 * pen, None, "x")


def beam_gaps(rng: random.Random, instances: int, *, nodes: tuple[int, int],
              slots: tuple[int, int], fixed_ms: float, var_ms: float) -> list[float]:
    """How far the joint search's beam + one-swap lands above the exhaustive optimum (J ratio
    - 1, per feasible instance) on random instances of 2-4 options per slot, forced down the
    beam path; the router bench and tests/router/test_search.py read it."""
    gaps: list[float] = []
    while len(gaps) < instances:
        n = rng.randint(*nodes)
        fixed = [rng.uniform(0, fixed_ms) for _ in range(n)]
        opts = [[_random_option(rng, n, var_ms) for _ in range(rng.randint(2, 4))]
                for _ in range(rng.randint(*slots))]
        budget = rng.choice([0.0, 0.005, 0.02])
        best = exhaustive(fixed, opts, budget)
        if best is None:
            continue
        found = joint(fixed, opts, budget, exhaustive_limit=1)
        gaps.append(evaluate(fixed, found)[0] / evaluate(fixed, best)[0] - 1.0)
    return gaps
