"""Plain data the router reasons about: replicas, placements, estimates, plans.

Everything here is frozen, validated on construction and free of I/O, so the cost model
(`router.cost`), the policies and offline placement can share it. Units live in the names:
`_ms` milliseconds, `_bytes`, `_per_s` per second, `rate_mbit` Mbit/s. Links are ONE-WAY: the
estimate for (a, b) describes what a sends to b.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moe.vocab import FULL_PRECISION, TIERS, VARIANTS, PlacementEntry, is_number

from .errors import BadRouterInput

__all__ = [
    "KINDS",
    "Choice",
    "LinkEstimate",
    "ModelShape",
    "NodeEstimate",
    "Placement",
    "Plan",
    "PlanRequest",
    "Replica",
    "Scales",
    "access_ms",
]

# How a chosen replica serves the expert the gate asked for (summary.json's "mix",
# docs/contracts.md).
KINDS = ("exact", "quantized", "substitute", "fallback")


def _positive(name: str, value: Any, *, zero_ok: bool = False) -> float:
    if not is_number(value):
        raise BadRouterInput(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not zero_ok):
        raise BadRouterInput(f"{name} must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return float(value)


def _index(name: str, value: Any) -> int:
    if not is_number(value, integer=True) or value < 0:
        raise BadRouterInput(f"{name} must be an integer >= 0, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy of expert `expert` of `layer` on `node`, in one precision and memory tier.

    tier "cpu" means the weights sit in host memory and must be copied to the device before
    use (unless the node reports them resident): that copy is the cost model's `load` term.
    """

    layer: int
    expert: int
    node: str
    variant: str = FULL_PRECISION
    tier: str = TIERS[0]

    def __post_init__(self) -> None:
        _index("layer", self.layer)
        _index("expert", self.expert)
        if not isinstance(self.node, str) or not self.node:
            raise BadRouterInput(f"replica node must be a non-empty string, got {self.node!r}")
        if self.variant not in VARIANTS:
            raise BadRouterInput(
                f"unknown variant {self.variant!r} for expert {self.expert} on layer "
                f"{self.layer}; known: {', '.join(VARIANTS)}"
            )
        if self.tier not in TIERS:
            raise BadRouterInput(f"unknown tier {self.tier!r}; known: {', '.join(TIERS)}")

    @property
    def key(self) -> tuple[int, int, str]:
        """(layer, expert, variant): how a node names what it has resident."""
        return (self.layer, self.expert, self.variant)

    @property
    def entry(self) -> PlacementEntry:
        """This replica as its node's placement lists it."""
        return PlacementEntry(self.layer, self.expert, self.variant, self.tier)


@dataclass(frozen=True)
class Placement:
    """Which replicas exist where: the router's view of the whole mesh."""

    replicas: tuple[Replica, ...]
    _by_expert: dict[tuple[int, int], tuple[Replica, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        seen: set[Replica] = set()
        index: dict[tuple[int, int], list[Replica]] = {}
        for r in self.replicas:
            if not isinstance(r, Replica):
                raise BadRouterInput(f"placement holds a non-replica {r!r}")
            if r in seen:
                raise BadRouterInput(f"duplicate replica {r}")
            seen.add(r)
            index.setdefault((r.layer, r.expert), []).append(r)
        object.__setattr__(self, "_by_expert", {k: tuple(v) for k, v in index.items()})

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> Placement:
        return cls(tuple(replicas))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Placement:
        """{NODE: [{"layer", "expert", "variant", "tier"}, ...]}: what each node's PUT
        /v1/placement carried, keyed by node name."""
        if not isinstance(data, Mapping):
            raise BadRouterInput(f"placement must map node names to expert lists, got {data!r}")
        out: list[Replica] = []
        for node, items in data.items():
            if not isinstance(items, list):
                raise BadRouterInput(f"placement of node {node!r} must be a list, got {items!r}")
            for item in items:
                if not isinstance(item, Mapping) or not {"layer", "expert"} <= set(item):
                    raise BadRouterInput(
                        f"placement item on node {node!r} needs layer and expert: {item!r}"
                    )
                out.append(
                    Replica(
                        item["layer"], item["expert"], node,
                        item.get("variant", FULL_PRECISION), item.get("tier", TIERS[0]),
                    )
                )
        return cls(tuple(out))

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in self.replicas:
            out.setdefault(r.node, []).append(r.entry.to_json())
        return out

    def of_expert(self, layer: int, expert: int) -> tuple[Replica, ...]:
        return self._by_expert.get((layer, expert), ())

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({r.node for r in self.replicas}))

    def check(self, layers: int, experts: int, nodes: Iterable[str] | None = None) -> None:
        """Raise if a replica lies outside the model or on an unknown node, or if an expert
        lacks a full-precision replica (the quality-safe fallback every placement keeps)."""
        known = set(nodes) if nodes is not None else None
        for r in self.replicas:
            if r.layer >= layers or r.expert >= experts:
                raise BadRouterInput(
                    f"replica {r} outside the model (layers 0–{layers - 1}, "
                    f"experts 0–{experts - 1})"
                )
            if known is not None and r.node not in known:
                raise BadRouterInput(f"replica {r} on unknown node {r.node!r}")
        for layer in range(layers):
            for e in range(experts):
                if not any(r.variant == FULL_PRECISION for r in self.of_expert(layer, e)):
                    raise BadRouterInput(
                        f"expert {e} of layer {layer} has no full-precision (fp16) replica"
                    )


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs of the model: payload bytes per row, FLOPs, expert sizes."""

    d_model: int
    expert_flops: float  # per row (token) through one expert
    expert_bytes: Mapping[str, int]  # per variant
    act_bytes: int = 4  # bytes per activation element on the wire (f32)

    def __post_init__(self) -> None:
        _positive("d_model", self.d_model)
        _positive("expert_flops", self.expert_flops)
        _positive("act_bytes", self.act_bytes)
        missing = [v for v in VARIANTS if v not in self.expert_bytes]
        if missing:
            raise BadRouterInput(f"expert_bytes lacks variant(s) {', '.join(missing)}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of activations (an expert's input, and its output)."""
        return self.d_model * self.act_bytes

    @classmethod
    def from_profile(cls, profile: Any, act_bytes: int = 4) -> ModelShape:
        """From a `moe.profiles.ModelProfile` (duck-typed: expert_flops_per_token,
        expert_bytes(variant), d_model)."""
        return cls(
            d_model=profile.d_model,
            expert_flops=float(profile.expert_flops_per_token()),
            expert_bytes={v: int(profile.expert_bytes(v)) for v in VARIANTS},
            act_bytes=act_bytes,
        )



def access_ms(nbytes: float, mbit: float | None) -> float:
    """ms to move nbytes through an access link of `mbit` Mbit/s (0 where there is none, or
    no rate is believed)."""
    return 0.0 if not mbit else nbytes * 8.0 / (mbit * 1e3)


@dataclass(frozen=True, slots=True)
class NodeEstimate:
    """What the router believes about one node now (priors corrected online).

    flops_per_s: expert throughput; h2d_bytes_per_s: host-to-device copy bandwidth (the load
    term); mem_bytes_per_s: device memory bandwidth, so an expert call costs at least one read
    of its weights (the roofline; None: FLOPs only, as a profile without `mem_gbps`);
    wait_ms: queue wait a request would meet now; queue: requests waiting there (the stability
    filter compares it with `capacity`); resident: (layer, expert, variant) held on the device,
    so a CPU-tier replica among them costs no load; uplink_mbit, downlink_mbit: the node's
    access link, which all its sends (receptions) share (None: none; docs/cost-model.md,
    "Access links").
    """

    flops_per_s: float
    h2d_bytes_per_s: float
    wait_ms: float = 0.0
    queue: float = 0.0
    capacity: float = 64.0
    resident: frozenset[tuple[int, int, str]] = frozenset()
    mem_bytes_per_s: float | None = None
    uplink_mbit: float | None = None
    downlink_mbit: float | None = None

    def __post_init__(self) -> None:
        _positive("flops_per_s", self.flops_per_s)
        _positive("h2d_bytes_per_s", self.h2d_bytes_per_s)
        if self.mem_bytes_per_s is not None:
            _positive("mem_bytes_per_s", self.mem_bytes_per_s)
        _positive("wait_ms", self.wait_ms, zero_ok=True)
        _positive("queue", self.queue, zero_ok=True)
        _positive("capacity", self.capacity)
        if self.uplink_mbit is not None:
            _positive("uplink_mbit", self.uplink_mbit)
        if self.downlink_mbit is not None:
            _positive("downlink_mbit", self.downlink_mbit)

    def uplink_ms(self, nbytes: float) -> float:
        """nbytes out through this node's access link (0 without one)."""
        return access_ms(nbytes, self.uplink_mbit)

    def downlink_ms(self, nbytes: float) -> float:
        """nbytes in through this node's access link (0 without one)."""
        return access_ms(nbytes, self.downlink_mbit)

    @property
    def stable(self) -> bool:
        """Load below capacity (HetRoute's stability filter)."""
        return self.queue < self.capacity


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """One-way link a→b: propagation delay and bandwidth as the router believes them now."""

    delay_ms: float
    rate_mbit: float

    def __post_init__(self) -> None:
        _positive("delay_ms", self.delay_ms, zero_ok=True)
        _positive("rate_mbit", self.rate_mbit)

    @property
    def ms_per_byte(self) -> float:
        return 8.0 / (self.rate_mbit * 1e3)

    def tx_ms(self, nbytes: float) -> float:
        """delay + serialisation of nbytes (docs/cost-model.md `tx`)."""
        return self.delay_ms + nbytes * self.ms_per_byte

    @classmethod
    def from_spec(cls, spec: Any, time_dilation: float = 1.0) -> LinkEstimate:
        """From a `netem.spec.LinkSpec` (duck-typed), in real time under time dilation."""
        return cls(spec.delay_ms * time_dilation, spec.rate_mbit / time_dilation)


@dataclass(frozen=True, slots=True)
class Scales:
    """One multiplicative correction per cost term, learned from predicted vs measured."""

    tx: float = 1.0
    wait: float = 1.0
    load: float = 1.0
    compute: float = 1.0


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """One token's experts at one layer, as the gate chose them.

    weights are the renormalised gate weights (they weigh each expert's quality penalty);
    budget_left is what remains of the token's quality budget (a fraction: 0.02 = 2%);
    exclude names nodes this token must not use (failed during this layer); batch, when the
    dispatcher plans several rows into one request per node, is per node (PlanView order)
    what the rows planned before this one already cost there (`PlanView.item_ms`), so this
    row's plan sees the batched request the node will serve; `calls` maps (node index,
    replica key) to the rows of that batch already calling the replica there, so a replica
    the batch already reads costs this row only its extra compute, never a second weight read
    or load.
    """

    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...]
    budget_left: float = 0.02
    rows: int = 1
    exclude: frozenset[str] = frozenset()
    batch: tuple[float, ...] | None = None
    calls: Mapping[tuple[int, tuple[int, int, str]], int] | None = field(
        default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.experts) != len(self.weights) or not self.experts:
            raise BadRouterInput(
                f"a plan request needs one weight per expert, got experts {self.experts} "
                f"and weights {self.weights}"
            )
        if self.rows < 1:
            raise BadRouterInput(f"rows must be >= 1, got {self.rows}")


@dataclass(frozen=True, slots=True)
class Choice:
    """How one slot of the top-k is served: `replica.expert` differs from `expert` for a
    substitute. `penalty` is the gate-weighted quality loss this choice spends."""

    slot: int
    expert: int
    weight: float
    replica: Replica
    kind: str
    penalty: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """A whole layer's assignment for one token, with the cost model's prediction."""

    layer: int
    choices: tuple[Choice, ...]
    latency_ms: float  # predicted bottleneck branch
    quality: float  # Σ gate-weighted penalties (fraction)
    objective: float  # latency_ms + quality_ms * quality

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({c.replica.node for c in self.choices}))
