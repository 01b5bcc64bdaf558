"""Modeled compute (no weights): generate is driven by a seeded routing trace."""

from __future__ import annotations

from contextlib import AsyncExitStack

import aiohttp

from moe.profiles import ModelProfile
from router.app import attach
from router.mesh import Mesh
from services import DeviceProfile, ModeledCompute, Node, NodeSettings
from services.tiers import parse_placement
from tests.router.conftest import TOKEN, experts, links_body, mesh_body

MINI = ModelProfile("mini", layers=3, experts=8, top_k=2, d_model=64, d_ff=128, heads=4,
                    kv_heads=4, head_dim=16, vocab_size=1000)
DEV = DeviceProfile("dev", gpu_tflops=0.001, gpu_mem_gb=1.0, cpu_mem_gb=1.0, h2d_gbps=10.0)


async def test_trace_driven_generation_over_http() -> None:
    placement = {"h": experts(3, range(4)), "a": experts(3, range(8))}
    delays = {("h", "a"): 1.0, ("a", "h"): 1.0}
    async with AsyncExitStack() as stack:
        nodes = {}
        for name in placement:
            node = Node(NodeSettings(name=name, token=TOKEN, profile=DEV, model="mini"),
                        compute=ModeledCompute(MINI))
            if name == "h":
                router = attach(node)
            await stack.enter_async_context(node)
            node.set_placement(parse_placement({"experts": placement[name]}, node.shape))
            await node.set_links(links_body(name, delays))
            nodes[name] = node
        urls = {n: node.url for n, node in nodes.items()}
        router.configure(Mesh.from_json(mesh_body(urls, placement, delays), "h"))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"tokens": [1, 2, 3, 4], "max_tokens": 6, "policy": "hetroute", "seed": 3}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
        assert out["failed"] is None and out["tokens"] == [] and len(out["records"]) == 6
        # one record per generated token (the first is the prefill's last row): 3 layers x 2
        assert all(len(r["choices"]) == 3 * 2 for r in out["records"])
        assert out["ttft_ms"] == out["records"][0]["latency_ms"]
        assert {c[3] for r in out["records"] for c in r["choices"]} <= {"h", "a"}
        async with session.post(urls["h"] + "/v1/generate", json=body) as resp:
            again = await resp.json()
        experts_of = [[c[1] for c in r["choices"]] for r in out["records"]]
        assert [[c[1] for c in r["choices"]] for r in again["records"]] == experts_of  # seeded
        async with session.post(urls["h"] + "/v1/score", json={"text": "abc"}) as resp:
            assert resp.status == 400
            assert "modeled mode" in (await resp.json())["detail"]
