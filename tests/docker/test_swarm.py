"""The swarm runtime against a real one-host Swarm: a stack of the generated file, nodes found by
name, a node killed and revived through the engine, then `docker stack rm` leaves nothing.

The runtime runs where the experiment's controller runs: in a service of the stack (the
overlay is not reachable from the host), here a one-shot `tester` service added to the
generated file that prints its findings as one JSON line. The test makes this engine a swarm
manager when it is not one (docker/swarm.sh init) and leaves again only then.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from netem.spec import LinkSpec
from orchestrator.compose.file import ComposeOptions, compose_text
from orchestrator.runtimes import make_runtime
from orchestrator.runtimes.swarm import SwarmRuntime, stack_from_env
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles
from tests.docker.conftest import docker_cli
from tests.helpers import ROOT

SWARM = ROOT / "docker" / "swarm.sh"

TESTER = r"""
import asyncio, json, os, time
from orchestrator.runtimes.base import NodeLaunch
from orchestrator.runtimes.swarm import SwarmRuntime
from services.client import ClientSettings, NodeClient

async def main():
    rt = SwarmRuntime(token=os.environ["MOEMESH_TOKEN"], ready_timeout_s=240)
    out = {"stack": rt.stack}
    async with rt, NodeClient(ClientSettings(token=rt.token)) as client:
        eps = await rt.start([NodeLaunch(n, ("moemesh", "node")) for n in ("edge1", "edge2")])
        out["health"] = {n: (await client.health(e.url))["name"] for n, e in eps.items()}
        out["before"] = eps["edge2"].address
        await rt.kill("edge2")
        out["running_after_kill"] = await rt.running("edge2")
        ep = await rt.revive("edge2")
        out["after"] = ep.address
        out["health_after"] = (await client.health(ep.url))["name"]
        out["fault_times"] = rt.fault_times
        out["notes"] = rt.notes
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main())
"""


def test_the_stack_is_read_from_swarms_expanded_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEMESH_SWARM_SERVICE", "mm_controller")
    assert stack_from_env() == "mm"
    assert isinstance(make_runtime("docker", "t"), SwarmRuntime)  # same file, Swarm's engine
    monkeypatch.setenv("MOEMESH_SWARM_SERVICE", "{{.Service.Name}}")  # Compose: not expanded
    assert stack_from_env() is None
    assert make_runtime("docker", "t").name == "docker"
    assert make_runtime("swarm", "t").name == "swarm"
    with pytest.raises(ValueError, match="unknown runtime 'nosuch'"):
        make_runtime("nosuch", "t")


def test_a_virtual_file_loads_in_a_stack_and_runs_on_the_clock_it_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Swarm stage of CI: the controller in a stack reads ci4.yaml (`clock: virtual`) with
    `--clock realtime`. Loading the file must not judge where it runs (it did: the stack's
    controller exited 2 before the flag was read); the clock the run takes is refused there,
    with the reason, only when it is virtual."""
    from experiments.run.clock import resolve_clock
    from orchestrator.scenario.arms import load_scenario

    monkeypatch.setenv("MOEMESH_SWARM_SERVICE", "mm_controller")
    scenario = load_scenario(Path(__file__).resolve().parents[2] / "docker" / "scenarios"
                             / "ci4.yaml")
    scenario = replace(scenario, runtime="docker")
    assert scenario.clock == "virtual"
    assert resolve_clock(scenario, "realtime")[0].clock == "realtime"
    with pytest.raises(ValueError, match="--clock virtual: Swarm"):
        resolve_clock(scenario)


async def test_swarm_runtime_without_a_stack_says_how_to_name_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure

    monkeypatch.delenv("MOEMESH_SWARM_SERVICE", raising=False)
    with pytest.raises(RuntimeFailure, match="which stack"):
        await SwarmRuntime(token="t").start([NodeLaunch("edge1", ("moemesh", "node"))])


async def test_swarm_runtime_without_an_engine_names_the_fix() -> None:
    from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure

    rt = SwarmRuntime(stack="mm", token="t", docker_url="unix:///nonexistent/moemesh.sock")
    with pytest.raises(RuntimeFailure, match=r"cannot reach the Docker engine.*start-dockerd"):
        await rt.start([NodeLaunch("edge1", ("moemesh", "node"))])


def _stack_file(tmp_path: Path, image: str, stack: str) -> Path:
    tiny = builtin_profiles()["tiny-edge"]
    topo = Topology.build([Node("edge1", tiny), Node("edge2", tiny)],
                          default=LinkSpec(delay_ms=2.0, rate_mbit=100.0), name="s2")
    data = yaml.safe_load(compose_text(topo, opts=ComposeOptions(image=image,
                                                                 build_context=None)))
    data.pop("x-moemesh-node")
    data["services"]["tester"] = {
        "image": image, "user": "root", "env_file": ["moemesh.env"],
        "environment": {"MOEMESH_SWARM_SERVICE": f"{stack}_controller"},
        "command": ["python", "-c", TESTER], "networks": ["mesh"],
        "volumes": ["/var/run/docker.sock:/var/run/docker.sock"],
        "healthcheck": {"disable": True},
        "deploy": {"restart_policy": {"condition": "none"},
                   "placement": {"constraints": ["node.role == manager"]}}}
    file = tmp_path / "stack.yaml"
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "moemesh.env").write_text(f"MOEMESH_TOKEN={secrets.token_hex(8)}\n")
    return file


def _tester_result(stack: str, timeout_s: float = 420.0) -> dict:
    deadline = time.monotonic() + timeout_s
    logs = ""
    while time.monotonic() < deadline:
        logs = docker_cli("service", "logs", "--raw", f"{stack}_tester", check=False)
        for line in logs.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        state = docker_cli("service", "ps", "--format", "{{.CurrentState}}", f"{stack}_tester",
                           check=False)
        if state.startswith(("Failed", "Complete")):
            break
        time.sleep(3)
    raise AssertionError(f"tester gave no result; its log:\n{logs[-3000:]}")


@pytest.mark.docker
@pytest.mark.slow
def test_stack_nodes_found_by_name_killed_revived_and_removed(image: str,
                                                              tmp_path: Path) -> None:
    support = subprocess.run(["bash", str(SWARM), "supported"], capture_output=True, text=True)
    if support.returncode != 0:
        pytest.skip(f"this engine cannot run the swarm test: {support.stderr.strip()}")
    made = subprocess.run(["bash", str(SWARM), "init"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stack = f"mmt{secrets.token_hex(3)}"
    file = _stack_file(tmp_path, image, stack)
    try:
        docker_cli("stack", "deploy", "-c", str(file), stack)
        result = _tester_result(stack)
    finally:
        removed = subprocess.run(["bash", str(SWARM), "rm", stack], capture_output=True,
                                 text=True)
        if made == "created":
            subprocess.run(["bash", str(SWARM), "leave"], check=True)
    assert removed.returncode == 0, removed.stderr  # no container, network or volume left
    assert result["stack"] == stack
    assert result["health"] == {"edge1": "edge1", "edge2": "edge2"}
    assert result["running_after_kill"] is False
    assert result["health_after"] == "edge2"
    (down,), (up,) = (result["fault_times"]["edge2"][i:i + 1] for i in (0, 1))
    assert down["how"] == "container killed (SIGKILL)" and up["state"] == "up"
    assert result["notes"] == []  # cap_add NET_ADMIN reached the services
    print(f"swarm fault times: {result['fault_times']}")  # shown with -s
