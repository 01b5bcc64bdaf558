"""`moemesh node` as a real process: ready line, SIGTERM drains, bad input exits 2."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from moe import load
from services import ClientSettings, NodeClient, NodeRefused
from services.wire import decode_tensor, expert_group
from tests.helpers import ROOT, TOKEN, env, node_process, wait_until


async def test_sigterm_drains_requests_in_flight_then_exits_0(
    small_model_dir: Path, tmp_path: Path
) -> None:
    model = load(small_model_dir)
    flops_row = 6 * model.config.d_model * model.config.d_ff
    profile = tmp_path / "slow.json"  # 150 ms per one-row request
    profile.write_text(json.dumps({"gpu_tflops": flops_row / 0.15 / 1e12, "gpu_mem_gb": 1,
                                   "cpu_mem_gb": 1, "h2d_gbps": 10}))
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"experts": [
        {"layer": 0, "expert": 2, "variant": "int8", "tier": "gpu"}]}))
    async with node_process(
        "--name", "p1", "--port", "0", "--model", str(small_model_dir), "--profile",
        str(profile), "--placement", str(placement), "--max-batch-rows", "1",
        log=tmp_path / "p1.log", token=TOKEN,
    ) as node, NodeClient(ClientSettings(token=TOKEN, forward_s=60)) as client:
        url, proc = node.url, node.proc
        xs = [torch.randn(1, model.config.d_model) for _ in range(5)]
        tasks = [asyncio.create_task(client.forward(url, [expert_group(0, 2, x, "int8")]))
                 for x in xs]

        async def queued(n: int) -> bool:
            return (await client.health(url))["queue"] >= n

        await wait_until(lambda: queued(3), "three requests queued", every_s=0.01)
        proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            return (await client.health(url))["status"] == "draining"

        await wait_until(draining, "the node draining", every_s=0.01)
        with pytest.raises(NodeRefused) as late:  # arrives while draining
            await client.forward(url, [expert_group(0, 2, xs[0], "int8")])
        answers = await asyncio.gather(*tasks)
        async with asyncio.timeout(60):
            code = await proc.wait()
    err = node.stderr()
    assert code == 0, err
    assert "draining" in err and "stopped after 5 requests" in err
    assert late.value.status == 503 and late.value.code == "shutting_down"
    with torch.inference_mode():
        for x, ans in zip(xs, answers, strict=True):
            want = model.expert(0, 2, "int8")(x)
            assert torch.equal(decode_tensor(ans.ys[0], "f32", 1, model.config.d_model), want)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--name", "x", "--profile", "nope"], "unknown device profile 'nope'"),
        (["--name", "x", "--model", "mixtral-8x7b", "--placement", "all-gpu",
          "--profile", "hetroute-s"], "GPU tier needs"),
    ],
)
async def test_bad_input_exits_2_naming_the_problem(args: list[str], words: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services", "node", *args, cwd=ROOT, env=env(MOEMESH_TOKEN=TOKEN),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    assert proc.returncode == 2, (out, err)
    assert words in err.decode()
