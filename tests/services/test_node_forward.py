"""Forward requests on a real node over a real socket: the numbers are the model's numbers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moe import combine_experts, load, profiles
from moe.vocab import VARIANTS
from services import DeviceProfile, ModeledCompute, Node, NodeClient, TorchCompute
from services.tiers import parse_placement
from services.wire import DTYPES, Group, decode_tensor, expert_group, make_group
from tests.helpers import wait_until

ULP = {"f32": 1e-5, "f16": 2.0**-10, "bf16": 2.0**-7}


@pytest.fixture(scope="module")
def reference(small_model_dir: Path):
    """A model loaded afresh by `moe.load`, independent of the node's own copy."""
    return load(small_model_dir)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
async def test_forward_equals_the_models_expert(
    node: Node, client: NodeClient, reference, variant: str, dtype: str
) -> None:
    d = node.shape.d_model
    x = torch.randn(5, d)
    resp = await client.forward(node.url, [expert_group(1, 3, x, variant, dtype)], req="t1")
    y = decode_tensor(resp.ys[0], dtype, 5, d)
    with torch.inference_mode():
        want = reference.expert(1, 3, variant)(x.to(DTYPES[dtype]).float()).to(DTYPES[dtype])
    assert y.dtype == DTYPES[dtype]
    assert torch.equal(y, want)
    assert resp.timing.queue_ms >= 0 and resp.timing.compute_ms > 0
    assert (1, 3, variant) in resp.state.resident


async def test_quantized_variants_really_differ(node: Node, client: NodeClient) -> None:
    x = torch.randn(4, node.shape.d_model)
    resp = await client.forward(node.url, [expert_group(0, 2, x, v) for v in VARIANTS])
    ys = dict(zip(VARIANTS, (decode_tensor(y, "f32", 4, node.shape.d_model) for y in resp.ys),
                  strict=True))
    fp, i8, i4 = ys["fp16"], ys["int8"], ys["int4"]
    err8 = (i8 - fp).norm() / fp.norm()
    err4 = (i4 - fp).norm() / fp.norm()
    assert 0 < err8 < err4 < 0.5


async def test_many_items_in_one_request_equal_one_by_one(node: Node, client: NodeClient) -> None:
    d = node.shape.d_model
    items = [
        expert_group(0, 1, torch.randn(3, d)),
        expert_group(0, 1, torch.randn(2, d), dtype="f16"),  # same expert: computed together
        expert_group(0, 2, torch.randn(1, d), "int8"),
        expert_group(1, 5, torch.randn(4, d), "int4", "bf16"),
        expert_group(0, 1, torch.randn(1, d)),
    ]
    together = await client.forward(node.url, items)
    assert len(together.ys) == len(items)
    for item, y in zip(items, together.ys, strict=True):
        alone = await client.forward(node.url, [item])
        a = decode_tensor(y, item.dtype, item.rows, d).float()
        b = decode_tensor(alone.ys[0], item.dtype, item.rows, d).float()
        # Batched rows may sum in another order (~1e-7 in fp32), which can move a value
        # rounded to f16/bf16 by one unit in the last place of that dtype.
        torch.testing.assert_close(a, b, rtol=ULP[item.dtype], atol=1e-6)


async def test_requests_waiting_together_are_batched_with_the_same_answers(
    compute: TorchCompute, client: NodeClient, make_settings
) -> None:
    flops_row = compute.flops(1)
    slow = DeviceProfile("slow", gpu_tflops=flops_row / 0.1 / 1e12, gpu_mem_gb=1,
                         cpu_mem_gb=1, h2d_gbps=100)  # 100 ms per row
    d = compute.shape.d_model
    async with Node(make_settings(profile=slow), compute=compute) as node:
        node.set_placement(parse_placement({"experts": [
            {"layer": 0, "expert": e, "variant": "fp16", "tier": "gpu"} for e in (1, 2)]},
            node.shape))
        first = asyncio.create_task(
            client.forward(node.url, [expert_group(0, 2, torch.randn(1, d))]))
        await wait_until(lambda: node.device.in_service == 1, "`first` in service")
        # the device is busy with `first` for 100 ms: the six below arrive meanwhile
        xs = [torch.randn(1, d) for _ in range(6)]
        answers = await asyncio.gather(*(client.forward(node.url, [expert_group(0, 1, x)])
                                         for x in xs))
        await first
        assert node.device.jobs_done == 7
        assert node.device.batches < 7  # the six that waited together ran as fewer batches
        solo = [await client.forward(node.url, [expert_group(0, 1, x)]) for x in xs]
    for a, b in zip(answers, solo, strict=True):
        torch.testing.assert_close(decode_tensor(a.ys[0], "f32", 1, d),
                                   decode_tensor(b.ys[0], "f32", 1, d), rtol=1e-5, atol=1e-6)


async def test_modeled_compute_answers_the_right_shape_in_flops_time(
    client: NodeClient, make_settings
) -> None:
    shape = profiles.get("mixtral-8x7b")
    rows = 2
    # Choose a throughput that makes this request 20 ms of emulated compute, then dilate x2.
    tflops = rows * shape.expert_flops_per_token() / 0.020 / 1e12
    prof = DeviceProfile("m", gpu_tflops=tflops, gpu_mem_gb=1, cpu_mem_gb=1, h2d_gbps=25)
    async with Node(make_settings(profile=prof, time_dilation=2.0),
                    compute=ModeledCompute(shape)) as node:
        node.set_placement(parse_placement({"experts": [
            {"layer": 31, "expert": 7, "variant": "fp16", "tier": "gpu"}]}, shape))
        x = torch.randn(rows, shape.d_model)
        resp = await client.forward(node.url, [expert_group(31, 7, x, "fp16", "f16")])
    assert len(resp.ys[0]) == rows * 4096 * 2
    assert resp.timing.compute_ms >= 40.0  # 20 ms x time dilation 2, deadline-based
    assert resp.timing.compute_ms < 1000.0
    assert resp.timing.load_ms == 0.0
    assert resp.state.resident == ((31, 7, "fp16"),)


async def test_a_token_group_answers_its_gate_weighted_sum_and_parts_on_request(
    node: Node, client: NodeClient, reference
) -> None:
    """Each row's experts run on the node and come back as one sum (experts ascending, as
    `moe.combine_experts` adds them: bit-identical for a one-row group; rows batched with
    others may round differently), and the unweighted parts when asked."""
    d = node.shape.d_model
    x = torch.randn(3, d)
    work = [[(5, "fp16", 0.25), (2, "fp16", 0.75)], [(1, "int8", 1.0)],
            [(2, "fp16", 0.5), (6, "int4", 0.5)]]
    group = make_group(1, x, work)
    plain = await client.forward(node.url, [group])
    resp = await client.forward(node.url, [group], parts=True)
    assert plain.parts is None and resp.ys == plain.ys
    y = decode_tensor(resp.ys[0], "f32", 3, d)
    parts = decode_tensor(resp.parts[0], "f32", 5, d)
    with torch.inference_mode():
        each = [reference.expert(1, e, v)(x[r:r + 1])[0] for r, row in enumerate(work)
                for e, v, _ in row]
        one = combine_experts(x[:1], torch.tensor([[5, 2]]), torch.tensor([[0.25, 0.75]]),
                              lambda e, rows: reference.expert(1, e)(rows))
    alone = await client.forward(node.url, [make_group(1, x[:1], work[:1])])
    assert torch.equal(decode_tensor(alone.ys[0], "f32", 1, d), one)
    torch.testing.assert_close(y[0], one[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts, torch.stack(each), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y[1], each[2])
    torch.testing.assert_close(y[2], 0.5 * each[3] + 0.5 * each[4], rtol=1e-5, atol=1e-6)


async def test_a_token_with_two_experts_on_a_node_moves_one_activation_and_one_answer(
    node: Node, client: NodeClient
) -> None:
    """Bytes of the real HTTP bodies (the client's count and the node's metrics agree): the
    token's two experts cost one row each way, not two (as version 1's items did)."""
    d = node.shape.d_model
    row = d * 4
    x = torch.randn(1, d)

    async def moved(groups) -> tuple[int, int]:
        before = (node.metrics.bytes_in._value.get(), node.metrics.bytes_out._value.get())
        resp = await client.forward(node.url, groups)
        after = (node.metrics.bytes_in._value.get(), node.metrics.bytes_out._value.get())
        assert resp.body_bytes == (after[0] - before[0], after[1] - before[1])
        return resp.body_bytes

    one = await moved([make_group(0, x, [[(1, "fp16", 1.0)]])])
    both = await moved([make_group(0, x, [[(1, "fp16", 0.6), (2, "fp16", 0.4)]])])
    apart = await moved([expert_group(0, 1, x), expert_group(0, 2, x)])  # one row per expert
    assert one[0] > row and one[1] > row
    assert both[0] - one[0] == 16  # [expert, variant, weight], not a second activation
    assert both[1] == one[1]  # one combined answer
    assert apart[0] - one[0] > row and apart[1] - one[1] >= row


async def test_a_version_1_request_is_a_400_naming_the_version(node: Node) -> None:
    import aiohttp
    import msgpack

    old = msgpack.packb({"req": "r", "items": [
        {"layer": 0, "expert": 1, "variant": "fp16", "dtype": "f32", "rows": 1,
         "x": bytes(4 * node.shape.d_model)}]}, use_bin_type=True)
    async with aiohttp.ClientSession() as session, session.post(
            node.url + "/v1/forward", data=old,
            headers={"Content-Type": "application/msgpack"}) as resp:
        body = msgpack.unpackb(await resp.read())
    assert resp.status == 400 and body["error"] == "malformed"
    assert "wire version 2" in body["detail"] and "version-1" in body["detail"]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
async def test_in_process_rows_as_a_tensor_answer_what_their_bytes_answer(
    node: Node, dtype: str
) -> None:
    """The home node's own rows travel as a tensor (Group.x): one row (the decode path) and
    several, through Node.forward, give exactly what the same rows as bytes give."""
    d = node.shape.d_model
    for rows in (1, 3):
        x = torch.randn(rows, d).to(DTYPES[dtype])
        before = x.clone()
        work = [[(5, "fp16", 0.25), (2, "int8", 0.75)]] * rows
        wire = make_group(1, x, work, dtype)
        local = Group(wire.layer, dtype, x, wire.work)
        y_wire = (await node.forward([wire]))[0][0][0]
        y_local = (await node.forward([local]))[0][0][0]
        assert isinstance(y_wire, bytes) and isinstance(y_local, torch.Tensor)
        assert y_local.dtype == DTYPES[dtype] and y_local.shape == (rows, d)
        assert torch.equal(decode_tensor(y_wire, dtype, rows, d), y_local)
        assert torch.equal(x, before)  # read, never written
