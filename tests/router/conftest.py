"""Fixtures for the router: small meshes of real nodes (aiohttp on real sockets, port 0).

`inproc_mesh` runs every node in this process (one event loop): quick, and enough to check
numbers and failover. The latency comparisons and the node kill use separate processes
(`test_router_mesh.py`), so a node's work does not share the router's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest

from moe import MoEModel
from router.app import RouterService, attach
from router.mesh import Mesh
from router.quality import QualityTable
from services import Node, NodeSettings, TorchCompute
from services.tiers import parse_placement
from tests.helpers import FAST, one_torch_thread  # noqa: F401 (autouse: nodes compute on one thread)

TOKEN = "router-test-token"


@pytest.fixture(scope="session")
def router_compute(small_model: MoEModel) -> TorchCompute:
    return TorchCompute(small_model, name="small-moe")


def experts(layers: int, ids, variant: str = "fp16", tier: str = "gpu") -> list[dict]:
    return [{"layer": layer, "expert": e, "variant": variant, "tier": tier}
            for layer in range(layers) for e in ids]


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


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s
