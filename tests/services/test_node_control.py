"""The control plane: the token, placement, links, metrics, errors, state across restarts."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
import torch

from services import DeviceProfile, Node, NodeClient, NodeRefused, TorchCompute
from services.wire import (
    ARRIVE_HEADER,
    CONTENT_TYPE,
    SELF_HEADER,
    expert_group,
    pack_request,
    unpack_error,
)
from tests.helpers import TOKEN

CONTROL_CALLS = [
    ("PUT", "/v1/placement", {"experts": []}),
    ("PUT", "/v1/links", {"backend": "app", "links": {"n2": {"delay_ms": 5}}}),
    ("POST", "/v1/faults", {"fail": 1.0}),
    ("GET", "/v1/health", None),
    ("GET", "/v1/stats", None),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN])
async def test_control_calls_without_the_token_get_401_and_change_nothing(
    node: Node, client: NodeClient, auth: str | None
) -> None:
    before = node.stats()
    headers = {} if auth is None else {"Authorization": auth}
    async with aiohttp.ClientSession() as s:
        for method, path, body in CONTROL_CALLS:
            async with s.request(method, node.url + path, json=body, headers=headers) as r:
                assert r.status == 401, path
                code, detail = unpack_error(await r.read(), r.content_type)
                assert code == "unauthorized" and "control token" in detail
    after = node.stats()
    for key in ("placement", "faults", "links"):
        assert after[key] == before[key]
    x = torch.randn(1, node.shape.d_model)
    await client.forward(node.url, [expert_group(0, 0, x)])  # the data plane needs no token


async def test_a_node_without_a_token_refuses_every_control_call(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    async with Node(make_settings(token=None), compute=compute) as node:
        with pytest.raises(NodeRefused, match=r"no control token.*MOEMESH_TOKEN") as info:
            await client.health(node.url)
    assert info.value.status == 401


async def test_placement_over_memory_is_refused_and_keeps_the_old_one(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    per_expert = compute.shape.expert_bytes("fp16")  # 6144 bytes for the small model
    small = DeviceProfile("small", gpu_tflops=1, gpu_mem_gb=1.5 * per_expert / 1e9,
                          cpu_mem_gb=1, h2d_gbps=1)
    one = [{"layer": 0, "expert": 0, "variant": "fp16", "tier": "gpu"}]
    two = [*one, {"layer": 0, "expert": 1, "variant": "fp16", "tier": "gpu"}]
    async with Node(make_settings(profile=small), compute=compute) as node:
        ok = await client.put_placement(node.url, one)
        assert ok["placed"] == 1 and ok["memory"]["gpu_tier"] == per_expert
        with pytest.raises(NodeRefused) as info:
            await client.put_placement(node.url, two)
        assert (await client.stats(node.url))["placement"] == one
    assert info.value.status == 409 and info.value.code == "does_not_fit"
    assert "GPU tier needs 1.2288e-05 GB but profile small has 9.216e-06 GB" in info.value.detail


async def test_placement_holds_exactly_the_listed_set(node: Node, client: NodeClient) -> None:
    entries = [{"layer": 1, "expert": 2, "variant": "int4", "tier": "cpu"},
               {"layer": 0, "expert": 7, "variant": "fp16", "tier": "gpu"}]
    await client.put_placement(node.url, entries)
    stats = await client.stats(node.url)
    assert sorted(stats["placement"], key=lambda p: p["layer"]) == [entries[1], entries[0]]
    with pytest.raises(NodeRefused) as info:
        await client.forward(node.url, [expert_group(0, 0, torch.randn(1, node.shape.d_model))])
    assert info.value.status == 404
    assert info.value.detail == "expert 0 not on this node; layer 0 holds 7"


async def test_metrics_appear_at_metrics(node: Node, client: NodeClient) -> None:
    x = torch.randn(2, node.shape.d_model)
    await client.forward(node.url, [expert_group(0, 0, x), expert_group(1, 1, x, "int8")])
    with pytest.raises(NodeRefused):
        await client.forward(node.url, [expert_group(5, 0, x)])
    text = await client.metrics(node.url)
    for line in (
        'moemesh_node_requests_total{endpoint="forward"} 2.0',
        'moemesh_node_errors_total{code="not_placed",status="404"} 1.0',
        "moemesh_node_items_total 4.0",  # expert executions: 2 groups x 2 rows
        "moemesh_node_queue_depth 0.0",
        "moemesh_node_queue_seconds_count 1.0",
        "moemesh_node_load_seconds_count 1.0",
        "moemesh_node_compute_seconds_count 1.0",
        "moemesh_node_service_seconds_bucket{le=",
        "moemesh_node_cache_hits_total 0.0",
        "moemesh_node_cache_misses_total 0.0",
    ):
        assert line in text, line
    bytes_in = [ln for ln in text.splitlines() if ln.startswith("moemesh_node_bytes_in_total")]
    assert float(bytes_in[0].split()[1]) > 2 * 2 * node.shape.d_model * 4


async def test_links_are_validated_applied_and_shape_answers(
    node: Node, client: NodeClient
) -> None:
    with pytest.raises(NodeRefused) as info:
        await client.put_links(node.url, {"n2": {"delay_ms": -1}}, backend="app")
    assert info.value.status == 400 and "link to n2: delay_ms" in info.value.detail
    # a refused set is not counted: `puts` counts the link sets the node accepted
    assert (await client.stats(node.url))["links"] == {"accepted": None, "applied": None,
                                                       "puts": 0}
    out = await client.put_links(node.url, {"n2": {"delay_ms": 40.0, "rate_mbit": 100.0}},
                                 backend="app")
    assert out["applied"]["backend"] == "app" and out["puts"] == 1
    assert out["applied"]["links"]["n2"]["delay_ms"] == 40.0
    body = pack_request([expert_group(0, 0, torch.randn(1, node.shape.d_model))])
    async with aiohttp.ClientSession() as s:
        due = {}
        for who in ("n2", "n3"):  # n3 has no link: its answers are not shaped
            start = time.perf_counter()
            async with s.post(node.url + "/v1/forward", data=body,
                              headers={SELF_HEADER: who, "Content-Type": CONTENT_TYPE}) as r:
                assert r.status == 200
                await r.read()
                # the answer says when it arrives on the emulated link; the receiver waits
                arrive = r.headers.get(ARRIVE_HEADER)
            due[who] = None if arrive is None else float(arrive) - start
    assert due["n2"] is not None and due["n2"] >= 0.040
    assert due["n3"] is None


async def test_http_errors_are_json_and_name_the_problem(node: Node) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(node.url + "/v1/nothing") as r:
            assert r.status == 404
            assert (await r.json())["error"] == "not_found"
        async with s.get(node.url + "/v1/forward") as r:  # data-plane path: msgpack
            assert r.status == 405
            code, detail = unpack_error(await r.read(), r.content_type)
            assert code == "method_not_allowed" and "allowed: POST" in detail
        async with s.put(node.url + "/v1/placement", data=b"{nope",
                         headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 400
            assert "body is not valid JSON" in (await r.json())["detail"]


async def test_oversized_body_is_413(compute: TorchCompute, make_settings) -> None:
    async with (
        Node(make_settings(max_body_bytes=1000), compute=compute) as node,
        aiohttp.ClientSession() as s,
        s.post(node.url + "/v1/forward", data=b"\x00" * 5000) as r,
    ):
        assert r.status == 413
        code, detail = unpack_error(await r.read(), r.content_type)
        assert code == "too_large" and "limit of 1000 bytes" in detail


async def test_a_restarted_node_restores_placement_and_links(
    compute: TorchCompute, client: NodeClient, make_settings, tmp_path: Path
) -> None:
    entries = [{"layer": 1, "expert": 3, "variant": "int8", "tier": "cpu"}]
    async with Node(make_settings(state_dir=tmp_path), compute=compute) as node:
        await client.put_placement(node.url, entries)
        await client.put_links(node.url, {"n2": {"delay_ms": 3.0}}, backend="app")
    async with Node(make_settings(state_dir=tmp_path), compute=compute) as again:
        stats = await client.stats(again.url)
    assert stats["placement"] == entries
    assert stats["links"]["applied"]["links"]["n2"]["delay_ms"] == 3.0
