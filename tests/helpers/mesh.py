"""Meshes for tests: placement lists, the PUT /v1/mesh and /v1/links bodies, and a mesh of
real nodes (aiohttp on real sockets, port 0) all in this process, the home node's router
attached. In one event loop: quick, and enough for numbers and failover; latency comparisons
and node kills use separate processes (`tests/router/test_router_mesh.py`)."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from moe import MoEModel
from moe.vocab import FULL_PRECISION, TIERS, PlacementEntry
from router.app import RouterService, attach
from router.mesh import Mesh
from router.quality import QualityTable
from services import Node, NodeSettings, TorchCompute
from services.tiers import parse_placement

from . import FAST, TOKEN

__all__ = ["InprocMesh", "all_experts", "experts", "links_body", "mesh_body",
           "start_inproc_mesh"]


def experts(layers: int, ids: Iterable[int], variant: str = FULL_PRECISION,
            tier: str = TIERS[0]) -> list[dict[str, Any]]:
    """PUT /v1/placement entries: experts `ids` of every layer below `layers`."""
    ids = list(ids)
    return [PlacementEntry(layer, e, variant, tier).to_json()
            for layer in range(layers) for e in ids]


def all_experts(shape: Any, variant: str = FULL_PRECISION,
                tier: str = TIERS[0]) -> list[dict[str, Any]]:
    """Every expert of a model `shape` (its layers and experts) in one variant and tier."""
    return experts(shape.layers, range(shape.experts), variant, tier)


def mesh_body(urls: dict[str, str], placement: dict[str, list[dict]],
              delays: dict[tuple[str, str], float], profile: dict | None = None,
              settings: dict | None = None) -> dict[str, Any]:
    """A PUT /v1/mesh body; `delays` are one-way (a, b) -> ms."""
    links: dict[str, dict] = {}
    for (a, b), d in delays.items():
        links.setdefault(a, {})[b] = {"delay_ms": d, "rate_mbit": 1000.0}
    return {
        "nodes": {n: {"url": u, **({"profile": profile} if profile else {})}
                  for n, u in urls.items()},
        "links": links,
        "placement": placement,
        "settings": settings or {},
    }


def links_body(name: str, delays: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The PUT /v1/links body of node `name` (its egress, app shaper)."""
    return {"backend": "app", "links": {
        b: {"delay_ms": d, "rate_mbit": 1000.0} for (a, b), d in delays.items() if a == name}}


@dataclass
class InprocMesh:
    nodes: dict[str, Node]
    router: RouterService
    model: MoEModel

    @property
    def urls(self) -> dict[str, str]:
        return {n: node.url for n, node in self.nodes.items()}


async def start_inproc_mesh(
    stack: AsyncExitStack, compute: TorchCompute, placement: dict[str, list[dict]],
    delays: dict[tuple[str, str], float], home: str = "h", settings: dict | None = None,
    quality: QualityTable | None = None,
) -> InprocMesh:
    """Start one node per `placement` key on `stack`, the router attached to `home`."""
    nodes = {}
    router = None
    for name in placement:
        node = Node(NodeSettings(name=name, token=TOKEN, profile=FAST), compute=compute)
        if name == home:
            router = attach(node, quality=quality or QualityTable.neutral(
                compute.shape.layers, compute.shape.experts))
        await stack.enter_async_context(node)
        node.set_placement(parse_placement({"experts": placement[name]}, node.shape))
        await node.set_links(links_body(name, delays))
        nodes[name] = node
    assert router is not None
    urls = {n: node.url for n, node in nodes.items()}
    router.configure(Mesh.from_json(mesh_body(urls, placement, delays, settings=settings),
                                    home))
    return InprocMesh(nodes, router, compute.model)
