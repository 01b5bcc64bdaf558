"""Modeled-compute nodes (no weights) on real sockets, one of them the home with the router:
shared by the trace-driven generation tests and the link probe's."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from moe.profiles import ModelProfile
from router.app import attach
from router.mesh import Mesh
from services import DeviceProfile, ModeledCompute, Node, NodeSettings
from services.tiers import parse_placement
from tests.helpers import TOKEN

DEV = DeviceProfile("dev", gpu_tflops=0.001, gpu_mem_gb=1.0, cpu_mem_gb=1.0, h2d_gbps=10.0)


@contextlib.asynccontextmanager
async def modeled_nodes(profile: ModelProfile, placement: Mapping[str, list[dict]],
                        links: Mapping[tuple[str, str], Mapping[str, Any]], home: str = "h",
                        device: DeviceProfile = DEV, tell_profile: bool = False,
                        uplinks: Mapping[str, float] | None = None,
                        downlinks: Mapping[str, float] | None = None,
                        ) -> AsyncIterator[tuple[dict[str, str], aiohttp.ClientSession]]:
    """Nodes named by `placement`, each shaping its one-way `links` (a, b) → spec with the app
    shaper (behind its access link, `uplinks[name]` and `downlinks[name]` Mbit/s, if given);
    the home's router knows
    the mesh (and, with `tell_profile`, the nodes' device; else its priors are the default
    profile's). Yields the URLs and a client session."""
    uplinks, downlinks = dict(uplinks or {}), dict(downlinks or {})
    async with AsyncExitStack() as stack:
        nodes = {}
        for name in placement:
            node = Node(NodeSettings(name=name, token=TOKEN, profile=device, model=profile.name),
                        compute=ModeledCompute(profile))
            if name == home:
                router = attach(node)
            await stack.enter_async_context(node)
            node.set_placement(parse_placement({"experts": placement[name]}, node.shape))
            await node.set_links({"backend": "app", "links": {
                b: dict(spec) for (a, b), spec in links.items() if a == name},
                **({"uplink_mbit": uplinks[name]} if name in uplinks else {}),
                **({"downlink_mbit": downlinks[name]} if name in downlinks else {})})
            nodes[name] = node
        urls = {n: node.url for n, node in nodes.items()}
        mesh_links: dict[str, dict] = {}
        for (a, b), spec in links.items():
            mesh_links.setdefault(a, {})[b] = dict(spec)
        told = {"profile": {k: v for k, v in device.to_json().items() if k != "name"}}
        router.configure(Mesh.from_json({"nodes": {n: {"url": u, **(told if tell_profile else {})}
                                                   for n, u in urls.items()},
                                         "links": mesh_links, "placement": dict(placement),
                                         "settings": {}}, home))
        yield urls, await stack.enter_async_context(aiohttp.ClientSession())
