"""Event-loop lag: the sampler sees a blocked loop, the endpoint needs the token, and control
actions (placement, links, faults) applied while forward requests stream never block the loop.

Bounds are generous on purpose (a shared 2-core host stalls a loop by tens of ms now and then):
the blocking work these tests inject takes 300 ms, so a control action done on the loop
would show a lag of ~300 ms, far above the 100 ms the tests allow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
import numpy as np
import pytest
import torch

from moe import MoEModel
from netem.timing import now
from services import Node, NodeClient, TorchCompute
from services.looplag import LoopLag, lag_summary
from services.wire import expert_group
from tests.helpers import TOKEN

BLOCK_S = 0.3  # what the injected blocking work takes
BOUND_MS = 100.0  # no lag sample may come near it while that work runs off the loop


async def test_the_sampler_records_a_blocked_loop() -> None:
    lag = LoopLag()
    lag.start()
    try:
        await asyncio.sleep(0.1)
        blocked_at = now()
        time.sleep(0.12)  # block the loop on purpose
        await asyncio.sleep(0.05)
    finally:
        await lag.stop()
    w = lag.window(blocked_at - 0.01)
    assert w["max_ms"] >= 100.0
    late = [(t, ms) for t, ms in w["samples"] if ms >= 100.0]
    assert len(late) == 1 and late[0][0] >= blocked_at + 0.11  # woke after the block ended
    assert w["over_5ms_count"] >= 1 and w["over_5ms_frac"] > 0.5  # ~115 of ~170 ms late
    # before the block the loop was free: nothing near the block's size
    before = lag.window(None, blocked_at)
    assert before["count"] >= 5 and before["max_ms"] < 100.0


def test_the_ring_keeps_the_last_samples_in_order() -> None:
    lag = LoopLag(capacity=4, clock=lambda: 100.0)
    lag.started_at = 0.0
    for i in range(1, 7):
        lag.record(float(i), i / 1000.0)
    w = lag.window(0.0, 10.0)
    assert [t for t, _ in w["samples"]] == [3.0, 4.0, 5.0, 6.0]
    assert w["lost"] and w["count"] == 4 and w["max_ms"] == 6.0
    assert [t for t, _ in lag.window(4.0, 10.0, min_ms=5.5)["samples"]] == [6.0]
    peaks = lag.window(2.0, 10.0, every_s=2.0)["peaks"]  # buckets [2,4), [4,6), [6,8)
    assert peaks == [[3.0, 3.0], [5.0, 5.0], [6.0, 6.0]]  # the worst of each


def test_summary_counts_the_time_spent_late() -> None:
    s = lag_summary(np.array([0.001, 0.105, 0.002]), span_s=1.0)
    assert s["max_ms"] == pytest.approx(105.0) and s["over_5ms_count"] == 1
    assert s["over_5ms_frac"] == pytest.approx(0.1)  # 100 ms of the second more than 5 ms late


async def test_the_endpoint_needs_the_token_and_filters(node: Node, client: NodeClient) -> None:
    await asyncio.sleep(0.15)
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with s.get(node.url + "/v1/looplag", headers=headers) as r:
                assert r.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with s.get(node.url + "/v1/looplag?since=abc", headers=auth) as r:
            assert r.status == 400 and "since" in (await r.json())["detail"]
    t = now()
    await asyncio.sleep(0.12)
    got = await client.loop_lag(node.url, t, min_ms=0.0, every_s=0.05)
    assert got["name"] == node.settings.name and got["now"] >= t
    assert 5 <= got["count"] <= 20 and got["interval_ms"] == 10.0
    assert all(t < ts <= got["now"] for ts, _ in got["samples"])
    assert {"p99_ms", "max_ms", "over_5ms_frac", "peaks"} <= set(got)
    metrics = await client.metrics(node.url)
    assert "moemesh_loop_lag_seconds_bucket" in metrics
    assert "moemesh_loop_lag_seconds_count" in metrics


# -- control actions while the data plane runs ---------------------------------------------------
class SlowPrepare(TorchCompute):
    """Quantizing and warming experts that takes BLOCK_S of blocking work."""

    def prepare(self, keys: Sequence) -> None:
        time.sleep(BLOCK_S)
        super().prepare(keys)


async def _stream(client: NodeClient, url: str, d: int, stop: asyncio.Event) -> list[float]:
    """Forward requests one after another until stopped; their latencies (ms)."""
    took = []
    while not stop.is_set():
        t = now()
        await client.forward(url, [expert_group(0, 1, torch.randn(1, d))])
        took.append((now() - t) * 1e3)
    return took


async def test_control_actions_do_not_block_the_loop_while_forwards_stream(
    small_model: MoEModel, client: NodeClient, make_settings, monkeypatch
) -> None:
    import services.links as links_module

    real = links_module.make_shaper

    def slow_make_shaper(*args, **kwargs):  # as `auto` probing the kernel would
        time.sleep(BLOCK_S)
        return real("app", time_dilation=kwargs.get("time_dilation", 1.0))

    monkeypatch.setattr(links_module, "make_shaper", slow_make_shaper)
    compute = SlowPrepare(small_model, name="small-moe")
    placement = {"experts": [{"layer": layer, "expert": e, "variant": v, "tier": "gpu"}
                             for v in ("fp16", "int8") for layer in range(2)
                             for e in range(8)]}
    async with Node(make_settings(), compute=compute) as node:
        await client.put_placement(node.url, placement["experts"])  # before the stream
        await asyncio.sleep(0.1)
        stop = asyncio.Event()
        start = now()
        stream = asyncio.create_task(_stream(client, node.url, node.shape.d_model, stop))
        await asyncio.sleep(0.1)
        t = now()
        await client.put_placement(node.url, placement["experts"][::-1])
        took_placement = now() - t
        t = now()
        await client.put_links(node.url, {"n2": {"delay_ms": 1.0}}, backend="auto")
        took_links = now() - t
        down = {"n2": {"delay_ms": 1.0, "loss_pct": 100.0}}
        await client.put_links(node.url, down, backend="auto")  # link-down: same shaper
        await client.post_faults(node.url, {"slow": 2.0})
        await client.post_faults(node.url, {"clear": True})
        await asyncio.sleep(0.1)
        stop.set()
        took = await stream
        w = node.loop_lag.window(start)
    assert took_placement >= BLOCK_S and took_links >= BLOCK_S  # the blocking work happened
    assert w["max_ms"] < BOUND_MS, w["samples"][-20:]
    assert w["count"] >= 50  # ~10 ms apart: the sampler kept running throughout
    # the data plane kept serving while the control calls ran: no request waited for them
    assert len(took) >= 10 and max(took) < BOUND_MS
