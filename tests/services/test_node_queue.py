"""The emulated device on a real node: load times, queueing, faults and overload.

Emulated times are waited for with absolute deadlines, so they are lower bounds that can be
asserted exactly; upper bounds here are loose (the CI host is shared), never the point.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from netem.timing import now
from services import DeviceProfile, Node, NodeClient, NodeRefused, TorchCompute
from services.tiers import parse_placement
from services.wire import expert_group
from tests.helpers import wait_until


def _place(node: Node, *entries: tuple[int, int, str, str]) -> None:
    body = {"experts": [{"layer": a, "expert": b, "variant": c, "tier": t}
                        for a, b, c, t in entries]}
    node.set_placement(parse_placement(body, node.shape))


def _profile(compute: TorchCompute, *, compute_s: float = 1e-6, load_s: float = 1e-6,
             ) -> DeviceProfile:
    """A device on which one row takes `compute_s` and loading an fp16 expert `load_s`."""
    return DeviceProfile(
        "t", gpu_tflops=compute.flops(1) / compute_s / 1e12, gpu_mem_gb=1, cpu_mem_gb=1,
        h2d_gbps=compute.shape.expert_bytes("fp16") / load_s / 1e9,
    )


async def test_cpu_tier_expert_pays_load_time_once_then_is_cached(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _profile(compute, load_s=0.02)
    async with Node(make_settings(profile=prof, time_dilation=3.0), compute=compute) as node:
        _place(node, (0, 4, "fp16", "cpu"), (0, 5, "fp16", "gpu"))
        x = torch.randn(1, node.shape.d_model)
        first = await client.forward(node.url, [expert_group(0, 4, x)])
        second = await client.forward(node.url, [expert_group(0, 4, x)])
        gpu = await client.forward(node.url, [expert_group(0, 5, x)])
        metrics = await client.metrics(node.url)
    assert first.timing.load_ms >= 60.0  # 20 ms x time dilation 3
    assert first.timing.load_ms < 1000.0
    assert second.timing.load_ms == 0.0 and gpu.timing.load_ms == 0.0
    assert (0, 4, "fp16") in first.state.resident
    assert first.ys == second.ys
    assert "moemesh_node_cache_misses_total 1.0" in metrics
    assert "moemesh_node_cache_hits_total 1.0" in metrics


async def test_a_long_queue_shows_in_state_and_queue_time(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _profile(compute, compute_s=0.1)
    # max_batch_rows=1: one request per batch, so the queue is served one by one.
    async with Node(make_settings(profile=prof, max_batch_rows=1), compute=compute) as node:
        _place(node, (0, 0, "fp16", "gpu"))
        x = torch.randn(1, node.shape.d_model)
        tasks = [asyncio.create_task(client.forward(node.url, [expert_group(0, 0, x)]))
                 for _ in range(10)]
        await wait_until(lambda: node.device.queue_depth >= 6 or all(t.done() for t in tasks),
                         "six requests waiting")
        health = await client.health(node.url)
        answers = await asyncio.gather(*tasks)
        assert node.device.batches == 10
    waits = sorted(a.timing.queue_ms for a in answers)
    assert waits[-1] >= 8 * 100.0  # the last one waited for at least eight 100 ms services
    assert all(a.timing.compute_ms >= 100.0 for a in answers)
    assert health["queue"] >= 5  # six waited a moment ago; one more may have entered service
    assert max(a.state.queue for a in answers) >= 5
    assert max(a.state.busy_ms for a in answers) >= 5 * 100.0
    assert answers[-1].state.queue == 0 or min(a.state.queue for a in answers) == 0


async def test_slow_fault_stretches_compute_and_fail_fault_refuses(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _profile(compute, compute_s=0.01)
    async with Node(make_settings(profile=prof), compute=compute) as node:
        _place(node, (0, 0, "fp16", "gpu"))
        item = expert_group(0, 0, torch.randn(1, node.shape.d_model))
        assert await client.post_faults(node.url, {"slow": 4}) == {"slow": 4.0, "fail": 0.0}
        slowed = await client.forward(node.url, [item])
        await client.post_faults(node.url, {"fail": 1.0})
        with pytest.raises(NodeRefused) as info:
            await client.forward(node.url, [item])
        await client.post_faults(node.url, {"clear": True})
        healed = await client.forward(node.url, [item])
        stats = await client.stats(node.url)
    assert slowed.timing.compute_ms >= 40.0
    assert info.value.status == 503 and info.value.code == "injected_fault"
    assert info.value.retryable
    assert healed.timing.compute_ms >= 10.0
    assert stats["faults"] == {"slow": 1.0, "fail": 0.0, "injected": 1}


async def test_a_full_queue_answers_503_overloaded_and_keeps_serving(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _profile(compute, compute_s=0.2)  # 8 requests arrive long before 3 are served
    async with Node(make_settings(profile=prof, max_queue=2, max_batch_rows=1),
                    compute=compute) as node:
        _place(node, (0, 0, "fp16", "gpu"))
        item = expert_group(0, 0, torch.randn(1, node.shape.d_model))
        results = await asyncio.gather(*(client.forward(node.url, [item]) for _ in range(8)),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, NodeRefused)]
        assert refused and all(r.status == 503 and r.code == "overloaded" for r in refused)
        assert "limit 2" in refused[0].detail
        assert len(results) - len(refused) >= 2  # the queue held two
        await client.forward(node.url, [item])  # and it goes on serving


async def test_an_expert_dropped_while_queued_is_answered_404(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _profile(compute, compute_s=0.5)  # long beside a loaded host's request time
    async with Node(make_settings(profile=prof, max_batch_rows=1), compute=compute) as node:
        _place(node, (0, 0, "fp16", "gpu"), (0, 1, "fp16", "gpu"))
        x = torch.randn(1, node.shape.d_model)
        busy = asyncio.create_task(client.forward(node.url, [expert_group(0, 0, x)]))
        await wait_until(lambda: node.device.in_service == 1, "the first request in service")
        queued = asyncio.create_task(client.forward(node.url, [expert_group(0, 1, x)]))
        await wait_until(lambda: node.device.queue_depth == 1, "the second request queued")
        assert node.device.in_service == 1 and not busy.done()
        _place(node, (0, 0, "fp16", "gpu"))
        await busy
        with pytest.raises(NodeRefused) as info:
            await queued
    assert info.value.status == 404
    assert "expert 1 not on this node; layer 0 holds 0" in info.value.detail


async def test_a_job_arriving_later_does_not_hold_back_the_batch_before_it(
    compute: TorchCompute, make_settings
) -> None:
    """Batches follow the emulated arrivals, not whatever piled up in the real queue: a job
    due later (the home node's own rows may be queued ahead of the clock) starts a batch of its
    own instead of making an earlier job wait for it."""
    prof = _profile(compute, compute_s=0.1)
    async with Node(make_settings(profile=prof), compute=compute) as node:
        _place(node, (0, 1, "fp16", "gpu"))
        x = torch.randn(1, node.shape.d_model)
        t0 = now()
        busy = asyncio.ensure_future(node.forward([expert_group(0, 1, x)], arrival=t0))
        await asyncio.sleep(0)  # the device takes it: busy until t0 + 100 ms (emulated)
        early = asyncio.ensure_future(node.forward([expert_group(0, 1, x)], arrival=t0))
        late = asyncio.ensure_future(node.forward([expert_group(0, 1, x)], arrival=t0 + 0.5))
        await asyncio.gather(busy, early, late)
        (_, early_t, _, _), (_, late_t, _, _) = early.result(), late.result()
    assert 99.0 <= early_t.queue_ms < 300.0  # behind the busy batch (100 ms), not the late job
    assert late_t.queue_ms < 100.0  # the device is free again when it arrives
