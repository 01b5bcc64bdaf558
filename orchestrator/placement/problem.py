"""What an offline placement decides on: nodes and their memory, expert sizes, costs, traffic.

A `PlacementProblem` is plain data built once from a scenario (`problem_from_scenario`) or
directly (tests): the nodes' GPU and CPU memory, the bytes of one expert per precision, the
router's cost model inputs (`router.cost.Estimates` from the topology's devices and ONE-WAY
links, `router.types.ModelShape`, `router.quality.QualityTable`) and *calibration traffic*:
tokens, each with a home node and the top-k experts (and gate weights) it asks for at every MoE
layer. Every policy and every figure of merit reads the same problem.

Where the traffic comes from (the first that exists):
- measured gate statistics of the model (`moe.gatestats`, real mode): per layer the popularity,
  and layer-to-layer transitions that steer a token's next experts (`traffic="stats"`);
- a synthetic trace with Zipf popularity, reuse and layer affinity (`moe.traces`), the same
  generator modeled-mode runs use (`traffic="trace"`).
Quality tables: measured (`QualityTable.from_stats`) or, without statistics, seeded synthetic
tables (`QualityTable.synthetic`), said in `quality_source`. Homes follow the workload's home
shares. Times are scenario time (no time dilation), in ms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe import profiles as model_profiles
from moe.vocab import FULL_PRECISION, VARIANTS
from router.cost import Estimates
from router.mesh import node_prior
from router.quality import QualityTable
from router.settings import Settings
from router.types import LinkEstimate, ModelShape

__all__ = [
    "CALIBRATION_TOKEN_LAYERS",
    "DEFAULT_ROUTER",
    "EACH_ARM",
    "PlacementError",
    "PlacementProblem",
    "model_profile",
    "problem_from_scenario",
    "stats_traffic",
    "trace_traffic",
]

DEFAULT_ROUTER = "hetroute"  # the router a placement is built for, unless told (router)
# a scenario's `placement.router: arm`: each arm's placement is built for the arm's own router
# (orchestrator.scenario.arms); where no arm is in view (`moemesh placement`), DEFAULT_ROUTER's
EACH_ARM = "arm"

# Token-layers of calibration traffic by default (tokens = this / layers, at least 128).
CALIBRATION_TOKEN_LAYERS = 8192
TRANSITION_STEER = 0.5  # weight of the layer-to-layer transitions when drawing from statistics


class PlacementError(ValueError):
    """A placement cannot exist (memory too small) or breaks a rule; the message says which."""


@dataclass(frozen=True)
class PlacementProblem:
    """Everything a placement policy needs (see the module docstring).

    `homes[t]` is token t's home node index, `experts[t, l]` its top-k experts at layer l and
    `weights[t, l]` their renormalised gate weights (heaviest first not required).
    `redundancy`: bytes of all replicas <= redundancy x bytes of one fp16 copy of every expert.
    """

    names: tuple[str, ...]
    gpu_bytes: tuple[int, ...]
    cpu_bytes: tuple[int, ...]
    layers: int
    experts: int
    top_k: int
    expert_bytes: Mapping[str, int]
    shape: ModelShape
    estimates: Estimates
    quality: QualityTable
    home_shares: tuple[float, ...]
    homes: np.ndarray
    token_experts: np.ndarray
    token_weights: np.ndarray
    redundancy: float = 2.0
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0
    settings: Settings = field(default_factory=Settings)
    model: str = "model"
    # FLOPs per token and MoE layer outside the routed experts (attention, gate, shared
    # experts): the part that runs where the dense part is (EdgeShard's stages)
    dense_flops: float = 0.0
    traffic_source: str = "given"
    quality_source: str = "given"
    # the router policy the placement simulates on the calibration traffic (evaluate.simulate):
    # HetRoute's pruning and GPU residency follow its picks, and every policy's expected cost
    router: str = DEFAULT_ROUTER

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0 or len(set(self.names)) != n:
            raise PlacementError(f"nodes must be distinct and at least one, got {self.names}")
        for what, values in (("gpu_bytes", self.gpu_bytes), ("cpu_bytes", self.cpu_bytes),
                             ("home_shares", self.home_shares)):
            if len(values) != n:
                raise PlacementError(f"{what} has {len(values)} entries for {n} nodes")
        if FULL_PRECISION not in self.variants or any(v not in VARIANTS for v in self.variants):
            raise PlacementError(f"variants must be among {', '.join(VARIANTS)} and include "
                                 f"fp16, got {list(self.variants)}")
        if not (isinstance(self.redundancy, int | float) and self.redundancy >= 1.0):
            raise PlacementError(f"redundancy must be >= 1.0, got {self.redundancy!r}")
        t, shape = self.homes.shape[0], (self.layers, self.top_k)
        if t == 0 or self.token_experts.shape != (t, *shape) \
                or self.token_weights.shape != (t, *shape):
            raise PlacementError(
                f"calibration traffic needs homes [T], experts and weights [T, {self.layers}, "
                f"{self.top_k}], got {self.homes.shape}, {self.token_experts.shape}, "
                f"{self.token_weights.shape}")
        if (self.quality.layers, self.quality.experts) != (self.layers, self.experts):
            raise PlacementError(f"quality tables cover {self.quality.layers}x"
                                 f"{self.quality.experts} experts, the model {self.layers}x"
                                 f"{self.experts}")

    # -- derived quantities ---------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return len(self.names)

    @property
    def tokens(self) -> int:
        return int(self.homes.shape[0])

    def bytes_of(self, variant: str) -> int:
        return int(self.expert_bytes[variant])

    @property
    def full_copy_bytes(self) -> int:
        """One fp16 copy of every expert."""
        return self.layers * self.experts * self.bytes_of(FULL_PRECISION)

    @property
    def budget_bytes(self) -> int:
        """What all replicas together may weigh (redundancy x one full copy)."""
        return math.floor(self.redundancy * self.full_copy_bytes + 0.5)

    def uses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every expert use of the calibration traffic, one (token, layer, slot) per entry:
        flat arrays of its home node, MoE layer, expert and gate weight."""
        t, layers, k = self.token_experts.shape
        return (np.repeat(self.homes, layers * k), np.tile(np.repeat(np.arange(layers), k), t),
                self.token_experts.reshape(-1), self.token_weights.reshape(-1))

    def demand(self) -> np.ndarray:
        """[nodes, layers, experts]: uses per calibration token of each expert, by home."""
        out = np.zeros((self.nodes, self.layers, self.experts))
        homes, layer, expert, _ = self.uses()
        np.add.at(out, (homes, layer, expert), 1.0)
        return out / self.tokens

    def popularity(self) -> np.ndarray:
        """[layers, experts]: uses per token, all homes together (sums to top_k per layer)."""
        return self.demand().sum(axis=0)

    def mean_gate(self) -> np.ndarray:
        """[layers, experts]: mean gate weight of an expert when chosen (1/top_k if never)."""
        total = np.zeros((self.layers, self.experts))
        count = np.zeros((self.layers, self.experts))
        _, layer, flat, weight = self.uses()
        np.add.at(total, (layer, flat), weight)
        np.add.at(count, (layer, flat), 1.0)
        return np.divide(total, count, out=np.full_like(total, 1.0 / self.top_k),
                         where=count > 0)

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "nodes": self.nodes, "layers": self.layers,
                "experts": self.experts, "top_k": self.top_k, "tokens": self.tokens,
                "redundancy": self.redundancy, "variants": list(self.variants),
                "traffic": self.traffic_source, "quality": self.quality_source}


# ----------------------------------------------------------------------------- traffic


def _softmax_like(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Gate weights that sum to 1 along the last axis, heaviest first (as router.synthetic)."""
    raw = np.sort(rng.random(shape) ** 2 + 0.05, axis=-1)[..., ::-1]
    return raw / raw.sum(axis=-1, keepdims=True)


def trace_traffic(profile: Any, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts [T, L, k], weights [T, L, k]) from `moe.traces.generate_trace`."""
    from moe.traces import generate_trace

    experts = generate_trace(profile, tokens, seed=seed)
    rng = np.random.default_rng([seed, 7])
    return experts, _softmax_like(rng, experts.shape)


def stats_traffic(stats: Any, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens drawn from measured gate statistics: layer 0 from its popularity, each next
    layer from popularity mixed with the transitions from the experts chosen below; weights
    proportional to each expert's mean gate weight when chosen."""
    pop = np.asarray(stats.popularity, dtype=float)
    layers, experts = pop.shape
    k = int(stats.top_k)
    trans = np.asarray(stats.transition, dtype=float)
    mass = np.asarray(stats.gate_mass, dtype=float)
    per_use = np.divide(mass, pop, out=np.full_like(mass, 1.0 / k), where=pop > 0)
    rng = np.random.default_rng([seed, 11])
    out = np.empty((tokens, layers, k), dtype=np.int64)
    weights = np.empty((tokens, layers, k))
    floor = 1e-6  # every expert stays drawable, so k distinct always exist
    for t in range(tokens):
        below: np.ndarray | None = None
        for layer in range(layers):
            p = pop[layer] + floor
            if below is not None and layer > 0:
                steer = trans[layer - 1][below].mean(axis=0)
                p = (1 - TRANSITION_STEER) * p + TRANSITION_STEER * (steer + floor)
            chosen = rng.choice(experts, size=k, replace=False, p=p / p.sum())
            out[t, layer] = chosen
            w = per_use[layer, chosen] + 1e-9
            weights[t, layer] = w / w.sum()
            below = chosen
    return out, weights


# ----------------------------------------------------------------------------- scenario


def model_profile(choice: Any) -> Any:
    """The `moe.profiles.ModelProfile` a scenario's model runs with (what the nodes size their
    experts by): a profile in modeled mode, the checkpoint's config in real mode."""
    from moe.config import ModelConfig
    from moe.registry import model_dir

    if choice.mode == "modeled":
        return model_profiles.get(choice.name)
    if choice.name == model_profiles.TINY:
        return model_profiles.get(choice.name)  # its config, or the defaults before training
    config = ModelConfig.load(model_dir(choice.name) / "config.json")
    return model_profiles.profile_of(config, str(choice.name))


def _stats_for(choice: Any) -> Any | None:
    if choice.mode != "real":
        return None
    from moe.errors import MoEError
    from moe.gatestats import load_stats

    try:
        return load_stats(choice.name)
    except (MoEError, OSError, ValueError):
        return None


def estimates_from_topology(topology: Any) -> Estimates:
    """The router's priors from the topology, in scenario time: device throughput, memory and
    host-to-device bandwidth (`router.mesh.node_prior`, as the router builds them), one-way link
    delay and rate, empty queues."""
    nodes = {n.name: node_prior(n.device) for n in topology.nodes}
    links = {(lk.src, lk.dst): LinkEstimate.from_spec(lk.spec) for lk in topology.links}
    return Estimates(nodes, links)


def problem_from_scenario(scenario: Any, *, tokens: int | None = None,
                          policy_seed: int | None = None) -> PlacementProblem:
    """The placement problem of a scenario (its topology, model, placement knobs, homes)."""
    profile = model_profile(scenario.model)
    spec = scenario.placement
    seed = spec.seed if spec.seed is not None else scenario.workload.seed
    if policy_seed is not None:
        seed = policy_seed
    count = tokens or max(128, CALIBRATION_TOKEN_LAYERS // profile.layers)
    if count < 1:
        raise PlacementError(f"calibration tokens must be >= 1, got {count}")
    stats = _stats_for(scenario.model)
    if stats is not None and (stats.layers, stats.experts) != (profile.layers, profile.experts):
        stats = None
    if stats is not None:
        experts, weights = stats_traffic(stats, count, seed)
        quality, traffic_source, quality_source = (QualityTable.from_stats(stats),
                                                   "gate statistics", "measured")
    else:
        experts, weights = trace_traffic(profile, count, seed)
        quality = QualityTable.synthetic(profile.layers, profile.experts, seed)
        traffic_source, quality_source = "synthetic trace", "synthetic (no gate statistics)"
    topo = scenario.topology
    shares = scenario.workload.home_shares(topo)
    names = topo.names
    rng = np.random.default_rng([seed, 3])
    p = np.array([shares[n] for n in names])
    homes = rng.choice(len(names), size=count, p=p / p.sum())
    settings = Settings(budget=scenario.quality_budget_pct / 100.0)
    act = 4 if settings.wire_dtype == "f32" else 2
    return PlacementProblem(
        names=names,
        gpu_bytes=tuple(n.device.gpu_bytes for n in topo.nodes),
        cpu_bytes=tuple(n.device.cpu_bytes for n in topo.nodes),
        layers=profile.layers, experts=profile.experts, top_k=profile.top_k,
        expert_bytes={v: int(profile.expert_bytes(v)) for v in VARIANTS},
        shape=ModelShape.from_profile(profile, act_bytes=act),
        estimates=estimates_from_topology(topo),
        quality=quality,
        home_shares=tuple(float(x) for x in p),
        homes=homes, token_experts=experts, token_weights=weights,
        redundancy=spec.redundancy, variants=tuple(spec.variants), seed=seed,
        settings=settings, model=scenario.model.name,
        dense_flops=profile.dense_flops_per_token() / profile.layers,
        traffic_source=traffic_source, quality_source=quality_source,
        router=DEFAULT_ROUTER if spec.router == EACH_ARM else spec.router,
    )

