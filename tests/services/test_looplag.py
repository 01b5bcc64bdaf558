"""Event-loop lag: the sampler sees a blocked loop, the endpoint needs the token, and control
actions (placement, links, faults) applied while forward requests stream never block the loop.

No test sleeps and hopes: each waits for the sampler's own samples (`_until`), and asserts on
what it measured: the length of the block it made, the sampler's interval, the samples'
times. The bounds a busy host could cross are stated against the effect they detect: the
blocking work injected takes BLOCK_S (600 ms), so a control action done on the loop would
show a lag or a gap of at least 590 ms; the tests allow half of BLOCK_S, room for a shared
2-core host's own stalls (up to 230 ms seen with `stress --cpu 2` at a higher priority than
the tests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

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

BLOCK_S = 0.6  # what the injected blocking work takes
BOUND_MS = BLOCK_S / 2 * 1e3  # no lag sample or gap may come near it while that work runs off
# the loop (on the loop it would be BLOCK_S less one sampling interval)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Return as soon as `condition()` holds (checked every 5 ms); TimeoutError after
    `timeout_s`: the event the test waits for, instead of a guessed sleep."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


async def test_the_sampler_records_a_blocked_loop() -> None:
    lag = LoopLag()
    lag.start()
    try:
        await _until(lambda: lag.samples >= 5)  # the sampler runs
        blocked_at = now()
        time.sleep(0.12)  # block the loop on purpose
        unblocked = now()
        seen = lag.samples
        await _until(lambda: lag.samples > seen)  # its first wake after the block
        end = now()
    finally:
        await lag.stop()
    block_ms, interval_ms = (unblocked - blocked_at) * 1e3, lag.interval_s * 1e3
    assert lag.window(None, blocked_at)["count"] >= 5
    w = lag.window(blocked_at, end)
    first_t, first_ms = w["samples"][0]
    assert first_t >= unblocked  # no sample while the loop was blocked: it woke after
    # it was due at most one interval into the block, so it is at least that much late
    assert first_ms >= block_ms - interval_ms - 0.1, (first_ms, block_ms)
    assert w["max_ms"] >= first_ms and w["over_5ms_count"] >= 1
    late_s = sum(max(0.0, ms - 5.0) for _, ms in w["samples"]) / 1e3
    assert w["over_5ms_frac"] == pytest.approx(min(1.0, late_s / (end - blocked_at)), abs=1e-3)


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
    await _until(lambda: node.loop_lag.window(t)["count"] >= 5)
    got = await client.loop_lag(node.url, t, min_ms=0.0, every_s=0.05)
    assert got["name"] == node.settings.name and got["now"] >= t
    # at most one sample per interval (each is due an interval after the one before)
    assert 5 <= got["count"] <= (got["now"] - t) / 0.010 + 1 and got["interval_ms"] == 10.0
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


async def _stream(client: NodeClient, url: str, d: int, stop: asyncio.Event,
                  took: list[tuple[float, float]]) -> None:
    """Forward requests one after another until stopped; (when done, latency ms) of each
    into `took`."""
    while not stop.is_set():
        t = now()
        await client.forward(url, [expert_group(0, 1, torch.randn(1, d))])
        took.append((now(), (now() - t) * 1e3))


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
        took: list[tuple[float, float]] = []
        stream = asyncio.create_task(_stream(client, node.url, node.shape.d_model, stop, took))
        await _until(lambda: len(took) >= 3)  # the stream is under way
        t = now()
        await client.put_placement(node.url, placement["experts"][::-1])
        placing = (t, now())
        t = now()
        await client.put_links(node.url, {"n2": {"delay_ms": 1.0}}, backend="auto")
        linking = (t, now())
        down = {"n2": {"delay_ms": 1.0, "loss_pct": 100.0}}
        await client.put_links(node.url, down, backend="auto")  # link-down: same shaper
        await client.post_faults(node.url, {"slow": 2.0})
        await client.post_faults(node.url, {"clear": True})
        stop.set()
        await stream
        w = node.loop_lag.window(start)
    for a, b in (placing, linking):  # the blocking work happened, and requests were served
        assert b - a >= BLOCK_S  # meanwhile: the data plane did not wait for it
        assert any(a < done < b for done, _ in took), (a, b, [d for d, _ in took])
    assert w["max_ms"] < BOUND_MS, w["samples"][-20:]
    stamps = [ts for ts, _ in w["samples"]]  # the sampler kept running throughout
    assert max(b - a for a, b in zip([start, *stamps], stamps, strict=False)) < BOUND_MS / 1e3
    assert max(ms for _, ms in took) < BOUND_MS
