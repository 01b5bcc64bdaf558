"""A small compose mesh for real: up, healthy, links applied, a node killed and revived, down.

Both Compose versions read the same generated file: Debian's docker-compose v1 (1.29) and the
`docker compose` v2 plugin (docker/install-compose-v2.sh). The docker runtime attaches to the
containers by service name, as the controller of compose.yaml does. After `down -v` the docker
CLI must list no container, network or volume of the project.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from netem.spec import LinkSpec
from orchestrator.compose.file import ComposeOptions, compose_text
from orchestrator.runtimes.base import NodeLaunch
from orchestrator.runtimes.docker import DockerRuntime
from orchestrator.scenario.topology import Node, Topology
from services.client import ClientSettings, NodeClient
from services.device import DeviceProfile, builtin_profiles
from services.errors import NodeRefused
from tests.docker.conftest import docker_cli, leftovers
from tests.helpers.machine import require_compose

pytestmark = pytest.mark.docker

COMPOSE = {"v1": ["docker-compose"], "v2": ["docker", "compose"]}
NAMES = ("edge1", "edge2", "edge3")


def mesh() -> Topology:
    tiny = builtin_profiles()["tiny-edge"]
    odd = DeviceProfile("custom", gpu_tflops=0.02, gpu_mem_gb=0.002, cpu_mem_gb=0.01,
                        h2d_gbps=0.2)
    nodes = [Node("edge1", tiny), Node("edge2", tiny), Node("edge3", odd)]
    return Topology.build(nodes, default=LinkSpec(delay_ms=2.0, rate_mbit=200.0),
                          symmetric={("edge1", "edge2"): LinkSpec(delay_ms=0.5)}, name="t3")


def compose(version: str, project: str, file: Path, *args: str, timeout: float = 240) -> str:
    done = subprocess.run([*COMPOSE[version], "-p", project, "-f", str(file), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=file.parent)
    assert done.returncode == 0, (f"{' '.join(COMPOSE[version])} {' '.join(args)} failed: "
                                  f"{done.stderr[-2000:]}")
    return done.stdout


def wait_healthy(project: str, count: int, timeout_s: float = 180.0) -> None:
    label = f"label=com.docker.compose.project={project}"
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        ids = docker_cli("ps", "-a", "-q", "--filter", label).split()
        states = [docker_cli("inspect", "-f", "{{.State.Status}}/{{.State.Health.Status}}", i)
                  for i in ids]
        if len(states) == count and all(s == "running/healthy" for s in states):
            return
        if any(s.startswith("exited") for s in states):
            break
        time.sleep(2)
    raise AssertionError(f"project {project}: not all {count} nodes healthy: {states}")


@pytest.mark.parametrize("version", ["v1", "v2"])
async def test_compose_mesh_health_kill_revive_down(version: str, image: str, tmp_path: Path,
                                                    expected_backend: str) -> None:
    require_compose(version)
    topology = mesh()
    token = secrets.token_hex(8)
    file = tmp_path / "compose.yaml"
    file.write_text(compose_text(topology, opts=ComposeOptions(image=image, build_context=None)))
    (tmp_path / "moemesh.env").write_text(f"MOEMESH_TOKEN={token}\n")
    project = f"mmtest{secrets.token_hex(3)}"
    try:
        compose(version, project, file, "up", "-d")
        wait_healthy(project, len(NAMES))
        async with DockerRuntime(attach=True, project=project, network="mesh",
                                 token=token) as rt:
            eps = await rt.start([NodeLaunch(n, ("moemesh", "node")) for n in NAMES])
            assert {e.port for e in eps.values()} == {8000}  # read from the containers
            async with NodeClient(ClientSettings(token=token)) as client:
                for name in NAMES:
                    health = await client.health(eps[name].url)
                    assert (health["name"], health["status"]) == (name, "ok")
                async with NodeClient(ClientSettings(token="wrong")) as stranger:
                    with pytest.raises(NodeRefused, match="401"):
                        await stranger.health(eps["edge1"].url)

                used = await rt.apply_links({n: topology.links_from(n) for n in NAMES})
                assert used == dict.fromkeys(NAMES, expected_backend)

                await rt.kill("edge3")  # node-down
                assert not await rt.running("edge3")
                assert docker_cli("inspect", "-f", "{{.State.Running}}",
                                  rt.container_id("edge3")) == "false"
                for name in ("edge1", "edge2"):
                    assert (await client.health(eps[name].url))["status"] == "ok"

                await rt.revive("edge3")  # node-up: same container, its saved links back
                stats = await client.stats(rt.endpoints()["edge3"].url)
                assert sorted(stats["links"]["accepted"]["links"]) == ["edge1", "edge2"]
                assert stats["links"]["applied"]["backend"] == expected_backend
                assert stats["profile"]["gpu_tflops"] == 0.02  # the custom device arrived
        # attach mode created nothing and removed nothing: compose's containers still run
        assert len(docker_cli("ps", "-q", "--filter",
                              f"label=com.docker.compose.project={project}").split()) == 3
    finally:
        compose(version, project, file, "down", "-v", "--remove-orphans", "-t", "5")
    assert leftovers(f"com.docker.compose.project={project}") == {
        "containers": "", "networks": "", "volumes": ""}


async def test_attach_without_a_project_says_so(image: str) -> None:
    name = f"nosuch{secrets.token_hex(3)}"
    rt = DockerRuntime(attach=True, token="t")
    with pytest.raises(Exception, match="compose project"):
        async with rt:
            await asyncio.wait_for(rt.start([NodeLaunch(name, ("moemesh", "node"))]), 60)
