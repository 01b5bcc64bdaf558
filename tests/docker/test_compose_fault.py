"""`moemesh fault ... --project NAME` and `moemesh status --project NAME` against a compose
mesh (no supervisor): the link is cut on the nodes' control planes and put back after --for,
a node's container is killed and started again; the token comes from the project's env file.
And the same cut into a compose run that is on: its tokens reroute.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netem.spec import LinkSpec
from orchestrator.compose.file import ComposeOptions, compose_text
from orchestrator.runtimes.base import NodeLaunch
from orchestrator.runtimes.docker import DockerRuntime
from orchestrator.scenario.topology import Node, Topology
from services.client import ClientSettings, NodeClient
from services.device import builtin_profiles
from tests.docker.conftest import docker_cli, leftovers
from tests.docker.test_compose_run import compose, wait_healthy
from tests.helpers.machine import require_compose

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]


def cli(cwd: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "MOEMESH_TOKEN"}  # from the env file
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd,
                            env={**env, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err[-2000:]}"
    return out


async def loss(rt: DockerRuntime, token: str, a: str, b: str) -> float:
    async with NodeClient(ClientSettings(token=token)) as client:
        stats = await client.stats(rt.endpoints()[a].url)
    return float(stats["links"]["accepted"]["links"][b]["loss_pct"])


async def test_fault_cli_cuts_and_restores_a_link_of_a_compose_mesh(image: str,
                                                                    tmp_path: Path) -> None:
    require_compose("v2")
    tiny = builtin_profiles()["tiny-edge"]
    topology = Topology.build([Node("edge1", tiny), Node("edge2", tiny)],
                              default=LinkSpec(delay_ms=2.0, rate_mbit=100.0), name="two")
    token = secrets.token_hex(8)
    file = tmp_path / "compose.yaml"
    file.write_text(compose_text(topology, opts=ComposeOptions(image=image, build_context=None)))
    (tmp_path / "moemesh.env").write_text(f"MOEMESH_TOKEN={token}\n")
    project = f"mmfault{secrets.token_hex(3)}"
    names = ("edge1", "edge2")
    try:
        compose("v2", project, file, "up", "-d")
        wait_healthy(project, 2, timeout_s=400.0)  # a loaded 2-core host
        async with DockerRuntime(attach=True, project=project, network="mesh",
                                 token=token) as rt:
            await rt.start([NodeLaunch(n, ("moemesh", "node")) for n in names])
            await rt.apply_links({n: topology.links_from(n) for n in names})
            assert await loss(rt, token, "edge1", "edge2") == 0.0

            finish(cli(tmp_path, "fault", "link-down", "edge1", "edge2", "--project", project))
            assert await loss(rt, token, "edge1", "edge2") == 100.0  # both directions cut
            assert await loss(rt, token, "edge2", "edge1") == 100.0
            status = finish(cli(tmp_path, "status", "--project", project))
            assert "link edge1→edge2 down" in status and "link edge2→edge1 down" in status
            finish(cli(tmp_path, "fault", "link-up", "edge1", "edge2", "--project", project))
            assert await loss(rt, token, "edge1", "edge2") == 0.0  # what it was before
            assert await loss(rt, token, "edge2", "edge1") == 0.0
            assert "links: none faulted" in finish(cli(tmp_path, "status", "--project", project))

            out = finish(cli(tmp_path, "fault", "link-down", "edge1", "edge2", "--oneway",
                             "--for", "2s", "--project", project))
            assert "reverted after 2 s" in out
            assert await loss(rt, token, "edge1", "edge2") == 0.0

            # a node whose container runs but whose server does not answer is named as such,
            # and the others are still reported
            docker_cli("kill", "-s", "STOP", f"{project}-edge2-1")
            try:
                status = finish(cli(tmp_path, "status", "--project", project))
            finally:
                docker_cli("kill", "-s", "CONT", f"{project}-edge2-1")
            assert "edge2        unreachable" in status and "no answer within 5 s" in status
            assert "edge1        up" in status

            finish(cli(tmp_path, "fault", "node-down", "edge2", "--project", project))
            assert not await rt.running("edge2")
            finish(cli(tmp_path, "fault", "node-up", "edge2", "--project", project))
            assert await rt.running("edge2")

        bad = cli(tmp_path, "fault", "link-down", "edge1", "edge9", "--project", project)
        _, err = bad.communicate(timeout=120)
        assert bad.returncode != 0 and "unknown node 'edge9'" in err
    finally:
        compose("v2", project, file, "down", "-v", "--remove-orphans", "-t", "5")
    assert leftovers(f"com.docker.compose.project={project}") == {
        "containers": "", "networks": "", "volumes": ""}
    assert docker_cli("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}") == ""


CUT3 = ROOT / "tests" / "docker" / "scenarios" / "cut3.yaml"


def controller_log(project: str, file: Path) -> str:
    return compose("v2", project, file, "logs", "--no-color", "controller")


@pytest.mark.slow  # a two-minute compose run end to end
def test_a_cut_from_the_cli_reroutes_a_running_compose_run(image: str, tmp_path: Path) -> None:
    """The README's `moemesh fault link-down ... --for 5s --project` while the controller's
    run is on: the tokens that crossed the cut pair rerouted, none was lost, the run finished.
    In virtual time the cut lands at whatever time the run has reached (docs/docker.md), so
    the test asserts where reroutes happen, not when."""
    require_compose("v2")
    (tmp_path / "cut3.yaml").write_text(CUT3.read_text())
    (tmp_path / "moemesh.env").write_text(f"MOEMESH_TOKEN={secrets.token_hex(8)}\n")
    (tmp_path / "results").mkdir()
    finish(cli(tmp_path, "compose", "cut3.yaml", "-o", "compose.yaml", "--image", image,
               "--no-build"))
    file = tmp_path / "compose.yaml"
    project = f"mmcut{secrets.token_hex(3)}"
    try:
        compose("v2", project, file, "up", "-d")
        deadline = time.monotonic() + 400.0  # the nodes' start on a loaded 2-core host
        while "requests 0/" not in controller_log(project, file):  # the arm has begun
            assert time.monotonic() < deadline, controller_log(project, file)[-2000:]
            time.sleep(0.5)
        fault = cli(tmp_path, "fault", "link-down", "edge1", "edge2", "--for", "5s",
                    "--project", project)
        time.sleep(3.0)
        status = finish(cli(tmp_path, "status", "--project", project))
        assert "link edge1→edge2 down" in status and "link edge2→edge1 down" in status
        assert "reverted after 5 s" in finish(fault)
        while "moemesh run: cut3 done" not in (log := controller_log(project, file)):
            assert time.monotonic() < deadline and "exited with code" not in log, log[-2000:]
            time.sleep(1.0)
    finally:
        compose("v2", project, file, "down", "-v", "--remove-orphans", "-t", "5")
    (report,) = (tmp_path / "results").iterdir()
    with open(report / "tokens.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) > 2000 and {r["status"] for r in rows} == {"ok"}  # nothing lost
    rerouted = [r for r in rows if int(r["reroutes"] or 0) > 0]
    assert rerouted, "no token met the cut"
    assert {r["home"] for r in rerouted} <= {"edge1", "edge2"}  # only the cut pair's
    notes = json.loads((report / "run.json").read_text())["runtime_notes"]
    assert any("links set from outside the run on edge1, edge2" in n for n in notes), notes
    assert "links set from outside the run" in (report / "report.md").read_text()
    assert leftovers(f"com.docker.compose.project={project}") == {
        "containers": "", "networks": "", "volumes": ""}
