"""The docker runtime starting its own containers through the Engine API, and cleaning up.

Whatever happens (success, a node that dies at start, a missing image, a cancelled start, as
Ctrl-C does), the docker CLI must afterwards list no container or network of the run.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from netem.spec import LinkSpec
from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure
from orchestrator.runtimes.docker import LABEL_RUN, DockerRuntime
from services.client import ClientSettings, NodeClient
from tests.docker.conftest import docker_cli, leftovers

NOTHING = {"containers": "", "networks": "", "volumes": ""}
NODE = ("moemesh", "node", "--name", "{name}", "--port", "{port}", "--profile", "tiny-edge")


@pytest.mark.docker
async def test_start_links_kill_revive_and_stop_leaves_nothing(
        image: str, expected_backend: str) -> None:
    launches = [
        NodeLaunch("n1", NODE, port=8000),
        # the host's python path becomes the image's python; another port works too
        NodeLaunch("n2", (sys.executable, "-m", "services", "node", "--name", "{name}",
                          "--port", "{port}"), port=8123),
    ]
    rt = DockerRuntime(image=image)
    async with rt:
        eps = await rt.start(launches)
        assert (eps["n1"].port, eps["n2"].port) == (8000, 8123)
        assert eps["n1"].address != eps["n2"].address
        assert docker_cli("network", "ls", "-q", "--filter", f"label={LABEL_RUN}={rt.id}")
        inspect = docker_cli("inspect", "-f", "{{.HostConfig.CapAdd}} {{.Config.User}}",
                             rt.container_id("n1"))
        assert "NET_ADMIN" in inspect and inspect.endswith("root")
        async with NodeClient(ClientSettings(token=rt.token)) as client:
            for name in ("n1", "n2"):
                assert (await client.health(eps[name].url))["name"] == name
            used = await rt.apply_links({"n1": {"n2": LinkSpec(delay_ms=3.0)},
                                         "n2": {"n1": LinkSpec(delay_ms=4.0)}})
            assert used == {"n1": expected_backend, "n2": expected_backend}
            with pytest.raises(ValueError, match="unknown node 'n9'"):
                await rt.apply_links({"n1": {"n9": LinkSpec()}})
            await rt.kill("n2")
            assert docker_cli("inspect", "-f", "{{.State.Running}}",
                              rt.container_id("n2")) == "false"
            await rt.revive("n2")
            stats = await client.stats(rt.endpoints()["n2"].url)
            assert stats["links"]["accepted"]["links"]["n1"]["delay_ms"] == 4.0
    assert leftovers(f"{LABEL_RUN}={rt.id}") == NOTHING


@pytest.mark.docker
async def test_a_node_that_dies_at_start_is_reported_and_everything_removed(image: str) -> None:
    rt = DockerRuntime(image=image, ready_timeout_s=60)
    bad = NodeLaunch("bad", ("moemesh", "node", "--name", "{name}", "--profile", "nosuch"))
    with pytest.raises(RuntimeFailure, match=r"node bad: container exited") as info:
        async with rt:
            await rt.start([NodeLaunch("ok1", NODE), bad])
    assert "unknown device profile 'nosuch'" in str(info.value)
    assert leftovers(f"{LABEL_RUN}={rt.id}") == NOTHING


@pytest.mark.docker
async def test_a_missing_image_names_the_fix_and_leaves_nothing() -> None:
    rt = DockerRuntime(image="moemesh/no-such-image:0")
    with pytest.raises(RuntimeFailure, match=r"moemesh/no-such-image:0.*build-image\.sh"):
        async with rt:
            await rt.start([NodeLaunch("n1", NODE)])
    assert leftovers(f"{LABEL_RUN}={rt.id}") == NOTHING


@pytest.mark.docker
async def test_cancelled_start_like_ctrl_c_removes_what_was_made(image: str) -> None:
    rt = DockerRuntime(image=image)

    async def run() -> None:
        async with rt:
            await rt.start([NodeLaunch(f"c{i}", NODE) for i in range(3)])
            await asyncio.sleep(600)

    task = asyncio.create_task(run())
    for _ in range(300):  # until the containers exist, then cancel mid-way
        await asyncio.sleep(0.1)
        if docker_cli("ps", "-a", "-q", "--filter", f"label={LABEL_RUN}={rt.id}"):
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert leftovers(f"{LABEL_RUN}={rt.id}") == NOTHING


async def test_an_unreachable_engine_names_where_and_what_to_do() -> None:
    rt = DockerRuntime(docker_url="unix:///nonexistent/moemesh-docker.sock")
    with pytest.raises(RuntimeFailure, match=r"cannot reach the Docker engine at "
                                             r"unix:///nonexistent.*start-dockerd\.sh"):
        async with rt:
            await rt.start([NodeLaunch("n1", NODE)])


async def test_bad_input_is_refused_before_anything_starts() -> None:
    rt = DockerRuntime(docker_url="unix:///nonexistent/moemesh-docker.sock")
    with pytest.raises(ValueError, match="no nodes"):
        await rt.start([])
    with pytest.raises(ValueError, match="given twice: n1"):
        await rt.start([NodeLaunch("n1", NODE), NodeLaunch("n1", NODE)])
    with pytest.raises(ValueError, match="unknown node 'zz'"):
        await rt.kill("zz")
