"""The roofline on a real node: an expert call costs max(FLOPs / peak, weight bytes / memory
bandwidth), its weights read once per batch whatever its number of rows.

The node reports the emulated compute of a batch (`compute_ms`) and waits it with an absolute
deadline, so the reported figure is asserted exactly and the wall time is a lower bound.
"""

from __future__ import annotations

import time

import pytest
import torch

from services import DeviceProfile, Node, NodeClient, TorchCompute
from services.tiers import parse_placement
from services.wire import expert_group, make_group

TDF = 2.0


def _roof(compute: TorchCompute, *, row_s: float, read_s: float) -> DeviceProfile:
    """A device on which one row's FLOPs take `row_s` and reading an fp16 expert `read_s`."""
    return DeviceProfile(
        "roof", gpu_tflops=compute.flops(1) / row_s / 1e12, gpu_mem_gb=1, cpu_mem_gb=1,
        h2d_gbps=100, mem_gbps=compute.shape.expert_bytes("fp16") / read_s / 1e9,
    )


def _place(node: Node, *keys: tuple[int, int, str]) -> None:
    body = {"experts": [{"layer": a, "expert": b, "variant": v, "tier": "gpu"}
                        for a, b, v in keys]}
    node.set_placement(parse_placement(body, node.shape))


async def test_a_memory_bound_batch_costs_one_weight_read_whatever_its_rows(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _roof(compute, row_s=1e-4, read_s=0.02)  # 8 rows: 0.8 ms of FLOPs, a 20 ms read
    read_ms = prof.read_s(compute.shape.expert_bytes("fp16")) * 1e3 * TDF
    assert read_ms == pytest.approx(40.0)
    async with Node(make_settings(profile=prof, time_dilation=TDF), compute=compute) as node:
        _place(node, (0, 0, "fp16"), (0, 1, "fp16"))
        d = node.shape.d_model
        one = await client.forward(node.url, [expert_group(0, 0, torch.randn(1, d))])
        started = time.monotonic()
        eight = await client.forward(node.url, [expert_group(0, 0, torch.randn(8, d))])
        wall_ms = (time.monotonic() - started) * 1e3
        both = make_group(0, torch.randn(2, d), [[(0, "fp16", 0.5), (1, "fp16", 0.5)]] * 2)
        two = await client.forward(node.url, [both])
        assert node.device.batches == 3
    assert one.timing.compute_ms == pytest.approx(read_ms)
    assert eight.timing.compute_ms == pytest.approx(read_ms)  # not 8x: the weights once
    assert wall_ms >= eight.timing.compute_ms  # enforced, not only reported
    assert two.timing.compute_ms == pytest.approx(2 * read_ms)  # two experts, two reads


async def test_a_compute_bound_batch_still_follows_its_flops(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _roof(compute, row_s=0.005, read_s=0.001)  # a row's FLOPs outweigh the read
    async with Node(make_settings(profile=prof, time_dilation=TDF), compute=compute) as node:
        _place(node, (0, 0, "fp16"))
        d = node.shape.d_model
        one = await client.forward(node.url, [expert_group(0, 0, torch.randn(1, d))])
        eight = await client.forward(node.url, [expert_group(0, 0, torch.randn(8, d))])
    assert one.timing.compute_ms == pytest.approx(5.0 * TDF)
    assert eight.timing.compute_ms == pytest.approx(8 * 5.0 * TDF)


async def test_int4_reads_its_own_bytes_about_a_quarter_of_fp16(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    prof = _roof(compute, row_s=1e-5, read_s=0.02)
    shape = compute.shape
    ratio = shape.expert_bytes("int4") / shape.expert_bytes("fp16")
    assert 0.25 <= ratio < 0.3  # 4-bit weights plus their group scales
    async with Node(make_settings(profile=prof, time_dilation=TDF), compute=compute) as node:
        _place(node, (0, 0, "fp16"), (0, 0, "int4"))
        x = torch.randn(1, node.shape.d_model)
        fp16 = await client.forward(node.url, [expert_group(0, 0, x)])
        int4 = await client.forward(node.url, [expert_group(0, 0, x, variant="int4")])
    assert int4.timing.compute_ms == pytest.approx(fp16.timing.compute_ms * ratio)


async def test_the_queue_estimate_is_what_the_batch_then_costs(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    """`busy_ms` (the router's wait) comes from the per-job estimate; it must be the roofline
    the worker then charges, the slow fault included."""
    prof = _roof(compute, row_s=1e-4, read_s=0.01)
    async with Node(make_settings(profile=prof, time_dilation=TDF), compute=compute) as node:
        _place(node, (0, 0, "fp16"), (0, 1, "fp16"))
        await client.post_faults(node.url, {"slow": 3})
        d = node.shape.d_model
        group = make_group(0, torch.randn(3, d), [[(0, "fp16", 1.0)], [(0, "fp16", 1.0)],
                                                  [(1, "fp16", 1.0)]])
        estimate_ms = node.device._estimate_s([group]) * 1e3
        answer = await client.forward(node.url, [group])
    assert answer.timing.compute_ms == pytest.approx(2 * 10.0 * TDF * 3)
    assert estimate_ms == pytest.approx(answer.timing.compute_ms + answer.timing.load_ms)


def test_a_profile_without_memory_bandwidth_is_flops_only() -> None:
    flops_only = DeviceProfile("f", gpu_tflops=1.0, gpu_mem_gb=1, cpu_mem_gb=1, h2d_gbps=1)
    assert flops_only.mem_gbps is None and flops_only.read_s(1e9) == 0.0
    assert flops_only.expert_s(2e9, 1e12) == pytest.approx(2e-3)
    roof = DeviceProfile("r", gpu_tflops=1.0, gpu_mem_gb=1, cpu_mem_gb=1, h2d_gbps=1,
                         mem_gbps=100)
    assert roof.expert_s(2e9, 1e9) == pytest.approx(1e-2)  # 10 ms read beats 2 ms of FLOPs
    assert roof.expert_s(2e10, 1e9) == pytest.approx(2e-2)
