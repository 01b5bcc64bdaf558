"""The router's picture of the mesh: nodes (URL, device, capacity), one-way links, placement.

The home node learns it from `PUT /v1/mesh` (the orchestrator knows the whole topology; each
node's own `PUT /v1/links` and `PUT /v1/placement` only tell it about itself):

    {"nodes": {NAME: {"url": "http://10.0.0.2:8000", "profile": "hetroute-m" | {...},
                      "capacity": 32, "uplink_mbit": 20}},     # access links: optional
     "links": {A: {B: {"delay_ms", "jitter_ms", "rate_mbit", "loss_pct"}}},   # ONE-WAY, A→B
     "placement": {NAME: [{"layer", "expert", "variant", "tier"}, ...]},
     "time_dilation": 1.0,
     "settings": {...router settings overrides...},
     "dense": {"pipelines": [[NAME per MoE layer], ...]}      # optional (router.pipeline)
              | {"aggregate": true},                           # (router.aggregate)
     "batching": {"mode": "none" | "iteration", "max_rows"?, "prefill_chunk"?}}  # optional
                                                               # (router.batching)

Links not listed are unshaped (loopback). Profiles are `services.device` profiles; the
router turns them into priors (`node_prior`: FLOP/s, device memory and host-to-device bytes/s,
in real time under time dilation, since the nodes stretch what they emulate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe.vocab import is_number
from netem.spec import ACCESS_FIELDS, check_access

from .batching import Batching
from .errors import BadRouterInput
from .estimators import UNSHAPED
from .settings import Settings
from .types import LinkEstimate, NodeEstimate, Placement

__all__ = ["DEFAULT_CAPACITY", "Mesh", "NodeInfo", "node_prior"]

DEFAULT_CAPACITY = 32  # requests waiting at a node before HetRoute calls it unstable


def node_prior(profile: Any, time_dilation: float = 1.0,
               capacity: float = DEFAULT_CAPACITY, uplink_mbit: float | None = None,
               downlink_mbit: float | None = None) -> NodeEstimate:
    """What the router believes of a node before any answer, from its `services.device`
    profile and its access link: every rate divided by the time dilation (the node stretches
    what it emulates). A profile without `mem_gbps` gives no memory term (FLOPs only, as the
    node charges)."""
    mem = profile.mem_gbps
    return NodeEstimate(
        flops_per_s=profile.gpu_tflops * 1e12 / time_dilation,
        h2d_bytes_per_s=profile.h2d_gbps * 1e9 / time_dilation,
        capacity=capacity,
        mem_bytes_per_s=None if mem is None else mem * 1e9 / time_dilation,
        uplink_mbit=None if uplink_mbit is None else uplink_mbit / time_dilation,
        downlink_mbit=None if downlink_mbit is None else downlink_mbit / time_dilation,
    )


@dataclass(frozen=True)
class NodeInfo:
    name: str
    url: str
    prior: NodeEstimate


@dataclass(frozen=True)
class Mesh:
    home: str
    nodes: Mapping[str, NodeInfo]
    links: Mapping[tuple[str, str], LinkEstimate]
    placement: Placement
    time_dilation: float = 1.0
    settings: Settings = field(default_factory=Settings)
    # Where the dense part runs: () at the home node; else EdgeShard's pipelines, each one
    # stage node per MoE layer (router.pipeline)
    pipelines: tuple[tuple[str, ...], ...] = ()
    # HetRoute's moving aggregation server (router.aggregate): each layer's outputs gather on
    # the node its one-step lookahead picks, the layer's KV cache moving there
    aggregate: bool = False
    # iteration-level batching of the home's requests (router.batching); none by default
    batching: Batching = field(default_factory=Batching)

    def __post_init__(self) -> None:
        if self.home not in self.nodes:
            raise BadRouterInput(
                f"the mesh does not list this node {self.home!r}; it lists "
                f"{', '.join(sorted(self.nodes)) or 'none'}"
            )
        unknown = sorted(set(self.placement.nodes) - set(self.nodes))
        if unknown:
            raise BadRouterInput(f"placement names unknown node(s) {', '.join(unknown)}")

    def link(self, a: str, b: str) -> LinkEstimate:
        return self.links.get((a, b), UNSHAPED)

    @classmethod
    def from_json(cls, data: Any, home: str, base: Settings | None = None) -> Mesh:
        """Parse the body of PUT /v1/mesh (see the module docstring); errors name the field."""
        from netem.spec import LinkSpec
        from services.device import DeviceProfile, load_profile

        if not isinstance(data, Mapping):
            raise BadRouterInput("mesh must be a JSON object with nodes, links, placement")
        unknown = sorted(set(data) - {"nodes", "links", "placement", "time_dilation", "settings",
                                      "dense", "batching"})
        if unknown:
            raise BadRouterInput(
                f"unknown mesh field(s) {', '.join(unknown)}; known: nodes, links, "
                "placement, time_dilation, settings, dense, batching"
            )
        tdf = data.get("time_dilation", 1.0)
        if not is_number(tdf, finite=False) or not tdf > 0:
            raise BadRouterInput(f"time_dilation must be a number > 0, got {tdf!r}")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, Mapping) or not raw_nodes:
            raise BadRouterInput("mesh.nodes must be a non-empty object of node name -> {url}")
        nodes = {}
        for name, info in raw_nodes.items():
            if not isinstance(info, Mapping) or not isinstance(info.get("url"), str):
                raise BadRouterInput(f"mesh.nodes.{name} needs a url string, got {info!r}")
            extra = sorted(set(info) - {"url", "profile", "capacity", *ACCESS_FIELDS})
            if extra:
                raise BadRouterInput(f"mesh.nodes.{name}: unknown field(s) {', '.join(extra)}")
            prof = info.get("profile")
            try:
                if isinstance(prof, Mapping):
                    profile = DeviceProfile.from_json(prof, name=f"{name}-profile")
                else:
                    profile = load_profile(prof)
            except ValueError as exc:
                raise BadRouterInput(f"mesh.nodes.{name}.profile: {exc}") from None
            capacity = info.get("capacity", DEFAULT_CAPACITY)
            for key in ACCESS_FIELDS:
                try:
                    check_access(info.get(key), key)
                except ValueError as exc:
                    raise BadRouterInput(f"mesh.nodes.{name}.{exc}") from None
            nodes[name] = NodeInfo(name, info["url"].rstrip("/"), node_prior(
                profile, tdf, capacity, info.get("uplink_mbit"), info.get("downlink_mbit")))
        links = {}
        raw_links = data.get("links", {})
        if not isinstance(raw_links, Mapping):
            raise BadRouterInput("mesh.links must map A -> {B: link}")
        for a, row in raw_links.items():
            if not isinstance(row, Mapping):
                raise BadRouterInput(f"mesh.links.{a} must map peer names to links")
            for b, spec in row.items():
                if a not in nodes or b not in nodes:
                    raise BadRouterInput(f"mesh.links.{a}.{b}: unknown node")
                try:
                    parsed = LinkSpec.from_json(spec)
                except ValueError as exc:
                    raise BadRouterInput(f"mesh.links.{a}.{b}: {exc}") from None
                links[(a, b)] = LinkEstimate.from_spec(parsed, tdf)
        placement = Placement.from_json(data.get("placement", {}))
        settings = Settings.from_json(data.get("settings"), base).dilated(tdf)
        dense = data.get("dense")
        aggregate = isinstance(dense, Mapping) and set(dense) == {"aggregate"}
        if aggregate and dense["aggregate"] is not True:
            raise BadRouterInput('mesh.dense.aggregate must be true (HetRoute\'s moving '
                                 'aggregation server), got ' + str(dense["aggregate"])[:40])
        pipelines = () if aggregate else _pipelines(dense, nodes)
        batching = Batching.from_json(data.get("batching"))
        return cls(home, nodes, links, placement, float(tdf), settings, pipelines, aggregate,
                   batching)


def _pipelines(dense: Any, nodes: Mapping[str, NodeInfo]) -> tuple[tuple[str, ...], ...]:
    """mesh.dense: absent or null (the dense part at home) or {"pipelines": [[NAME per MoE
    layer], ...]} of known nodes, every pipeline as long as the others."""
    if dense is None:
        return ()
    if not isinstance(dense, Mapping) or set(dense) != {"pipelines"}:
        raise BadRouterInput('mesh.dense must be {"pipelines": [[node per MoE layer], ...]} '
                             'or {"aggregate": true}')
    raw = dense["pipelines"]
    if not isinstance(raw, list) or not raw:
        raise BadRouterInput("mesh.dense.pipelines must be a non-empty list of node lists")
    out = []
    for i, stages in enumerate(raw):
        if not isinstance(stages, list) or not stages or \
                not all(isinstance(s, str) and s in nodes for s in stages):
            raise BadRouterInput(f"mesh.dense.pipelines[{i}] must list known nodes, one per "
                                 f"MoE layer, got {str(stages)[:80]}")
        out.append(tuple(stages))
    if len({len(x) for x in out}) != 1:
        raise BadRouterInput("mesh.dense.pipelines must all have one stage per MoE layer")
    return tuple(out)
