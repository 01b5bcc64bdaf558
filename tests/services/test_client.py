"""The node client's typed errors, and how compute is chosen for a model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from netem.timing import now
from services import (
    ClientSettings,
    DeviceProfile,
    Node,
    NodeClient,
    NodeTimeout,
    NodeUnreachable,
    TorchCompute,
    make_compute,
)
from services.tiers import parse_placement
from services.wire import expert_group
from tests.helpers import TOKEN, free_port


async def test_a_closed_port_is_node_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with NodeClient(ClientSettings(token="t")) as client:
        with pytest.raises(NodeUnreachable) as info:
            await client.forward(url, [expert_group(0, 0, torch.zeros(1, 4))])
        with pytest.raises(ConnectionError):  # NodeUnreachable is a ConnectionError too
            await client.health(url)
    assert info.value.url == url


async def test_a_slow_node_is_node_timeout_and_the_client_goes_on(
    compute: TorchCompute, make_settings
) -> None:
    slow = DeviceProfile("slow", gpu_tflops=compute.flops(1) / 0.5 / 1e12, gpu_mem_gb=1,
                         cpu_mem_gb=1, h2d_gbps=1)  # half a second per row
    async with (
        Node(make_settings(profile=slow), compute=compute) as node,
        NodeClient(ClientSettings(token=TOKEN, forward_s=0.1)) as client,
    ):
        node.set_placement(parse_placement({"experts": [
            {"layer": 0, "expert": 0, "variant": "fp16", "tier": "gpu"}]}, node.shape))
        item = expert_group(0, 0, torch.randn(1, node.shape.d_model))
        with pytest.raises(NodeTimeout, match=r"no answer within 0\.1 s"):
            await client.forward(node.url, [item])
        assert (await client.health(node.url))["status"] == "ok"
        answer = await client.forward(node.url, [item], timeout_s=10)
        assert answer.timing.compute_ms >= 500


def test_compute_follows_the_model(small_model_dir: Path) -> None:
    assert make_compute("mixtral-8x7b").mode == "modeled"
    assert make_compute(str(small_model_dir)).mode == "real"
    modeled = make_compute(str(small_model_dir), "modeled")
    assert modeled.mode == "modeled" and modeled.shape.d_model == 32
    with pytest.raises(ValueError, match="compute mode real needs weights"):
        make_compute("mixtral-8x7b", "real")
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        make_compute("no-such-model")


async def test_requests_to_a_named_peer_wait_for_the_link(node: Node) -> None:
    """The app shaper in the client's path: A→B is shaped in A, before the request leaves.
    Checked on what the link scheduled (emulated time, exact to 1 ms) and by a lower bound on
    the wall (a shaped request cannot be early); no wall time is compared with another."""
    links = node.links
    await links.put({"backend": "app", "links": {"far": {"delay_ms": 30.0}}})
    scheduled: dict[str, float | None] = {}
    real = links.schedule_span

    async def spy(peer: str, nbytes: int, **kw: Any) -> tuple[float, float] | None:
        at = kw.get("at") if kw.get("at") is not None else now()
        span = await real(peer, nbytes, **kw)
        scheduled[peer] = None if span is None else span[1] - at
        return span

    links.schedule_span = spy  # type: ignore[method-assign]
    item = expert_group(0, 0, torch.randn(1, node.shape.d_model))
    async with NodeClient(ClientSettings(name="me"), links=links) as client:
        await client.forward(node.url, [item])  # a connection, warm
        t0 = time.perf_counter()
        await client.forward(node.url, [item], peer="far")
        shaped = time.perf_counter() - t0
        await client.forward(node.url, [item], peer="near")  # no link: not shaped
    assert scheduled["far"] == pytest.approx(0.030, abs=0.001)  # delay + ~0 serialisation
    assert scheduled["near"] is None
    assert shaped >= 0.030
