"""The node supervisor (orchestrator.mesh.supervisor) on real processes of the local runtime: a node
killed with SIGKILL, one stopped with SIGSTOP (hung), and one a fault took down.

The mesh here is the part of `LiveMesh` the supervisor uses (`launcher`, `urls`, `down`,
`client`) around a real `LocalRuntime`, real node processes (a small aiohttp server with
`/v1/health`) and a real `NodeClient`; a full mesh is tested in
tests/experiments/test_run_live.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from orchestrator.mesh.supervisor import Supervisor, supervise
from orchestrator.runclock import RunClock
from orchestrator.runtimes.base import NodeLaunch
from orchestrator.runtimes.local import LocalRuntime
from services.client import ClientSettings, NodeClient

SERVER = str(Path(__file__).parent.parent / "netem" / "aiohttp_node.py")


def _launch(name: str) -> NodeLaunch:
    return NodeLaunch(name, (sys.executable, SERVER, "{name}", "{port}"))


async def test_deaths_are_recorded_with_their_log_and_scheduled_downs_are_not(
        tmp_path: Path) -> None:
    async with LocalRuntime(fork_server=False) as rt, NodeClient(ClientSettings(
            control_s=2.0)) as client:
        eps = await rt.start([_launch(n) for n in ("a", "b", "c")])
        mesh = SimpleNamespace(launcher=rt, urls={n: e.url for n, e in eps.items()},
                               down=set(), client=client)
        logs = tmp_path / "out" / "logs"
        async with supervise(mesh, logs, every_s=0.1, silent_s=1.0) as watch:
            await asyncio.sleep(0.3)
            assert watch.deaths == []  # healthy nodes: nothing
            mesh.down.add("c")  # a node-down fault: marked down first, then killed
            await rt.kill("c")
            pids = rt.processes()
            os.kill(pids["a"][0], signal.SIGKILL)  # a crash
            os.kill(pids["b"][0], signal.SIGSTOP)  # a hang: alive, never answers
            for _ in range(100):
                if len(watch.deaths) == 2:
                    break
                await asyncio.sleep(0.1)
        by_node = {d.node: d for d in watch.deaths}
        assert set(by_node) == {"a", "b"}  # c's scheduled down is not a death
        assert by_node["a"].how == "exited (no fault scheduled)"
        assert by_node["b"].how.startswith("stopped answering for")
        assert "killed by the supervisor" in by_node["b"].how
        assert not await rt.running("b")  # the hung node was ended
        assert mesh.down == {"a", "b", "c"}  # the next reset restarts them
        for name in ("a", "b"):
            assert by_node[name].log == f"logs/{name}.log"
            assert f"aiohttp_node {name} listening" in (logs / f"{name}.log").read_text()
        assert by_node["a"].to_json(by_node["a"].at - 2.0, RunClock(2.0))["at_s"] == 1.0


async def test_a_target_without_a_runtime_is_not_watched() -> None:
    sup = Supervisor(SimpleNamespace(urls={}), None)
    assert not sup.can_watch
    async with supervise(SimpleNamespace(urls={}), None) as watch:
        await asyncio.sleep(0.01)
    assert watch.deaths == []


def test_a_runtimes_notes_and_how_its_nodes_went_down_become_runtime_notes() -> None:
    from orchestrator.mesh.supervisor import runtime_notes

    swarm_like = SimpleNamespace(
        notes=["service mm_edge1 has no NET_ADMIN"],
        fault_times={"edge3": [{"state": "down", "how": "container killed (SIGKILL)",
                                "seconds": 1.2}]})
    assert runtime_notes(swarm_like) == ["service mm_edge1 has no NET_ADMIN",
                                         "node edge3 down: container killed (SIGKILL) (1.2 s)"]
    assert runtime_notes(None) == [] and runtime_notes(object()) == []
