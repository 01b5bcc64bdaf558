"""The local runtime: real node processes on loopback, killed and revived, and nothing left
behind after stop, a failed start or a cancelled one (Ctrl-C). Processes are looked for in
/proc by a marker in their command line, not through the runtime under test."""

from __future__ import annotations

import asyncio
import sys
import uuid

import pytest

from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure
from orchestrator.runtimes.local import LocalRuntime, process_alive
from services.client import ClientSettings, NodeClient
from services.errors import NodeUnreachable
from tests.helpers import processes_with, wait_until

pytestmark = pytest.mark.slow
TOKEN = "local-runtime-test"


def node(name: str, marker: str) -> NodeLaunch:
    """A modeled tiny-moe node; `marker` rides in its command line (an unused state folder)."""
    argv = (sys.executable, "-m", "services", "node", "--name", "{name}", "--host", "{address}",
            "--port", "{port}", "--model", "tiny-moe", "--compute", "modeled",
            "--state-dir", f"/nonexistent/{marker}-{name}")
    return NodeLaunch(name, argv, env={"MOEMESH_TOKEN": TOKEN})


async def test_start_kill_revive_stop_leaves_nothing() -> None:
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    async with NodeClient(ClientSettings(token=TOKEN, control_s=10)) as client:
        async with LocalRuntime() as rt:
            eps = await rt.start([node("a", marker), node("b", marker)])
            assert set(eps) == {"a", "b"} and eps["a"].port != eps["b"].port
            for name, ep in eps.items():
                assert ep.host == ep.address == "127.0.0.1"
                assert (await client.health(ep.url))["name"] == name
            procs = rt.processes()
            assert sorted(processes_with(marker)) == sorted(p for p, _ in procs.values())
            await rt.kill("a")
            assert not process_alive(*procs["a"]) and process_alive(*procs["b"])
            with pytest.raises(NodeUnreachable):
                await client.health(eps["a"].url)
            again = await rt.revive("a")
            assert again.port == eps["a"].port  # peers' URLs stay valid
            assert (await client.health(again.url))["name"] == "a"
            assert rt.processes()["a"] != procs["a"]
            log_dir = rt.log_dir
            assert log_dir is not None and (log_dir / "a.log").exists()
        assert processes_with(marker) == []
        assert not log_dir.exists()


async def test_a_node_that_cannot_start_fails_the_start_and_nothing_is_left() -> None:
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    bad = NodeLaunch("bad", (sys.executable, "-c", f"print('{marker} boom'); raise SystemExit(3)"))
    rt = LocalRuntime(ready_timeout_s=60)
    with pytest.raises(RuntimeFailure, match=r"node bad did not start .*\n.*boom"):
        await rt.start([node("good", marker), bad])
    assert processes_with(marker) == []
    assert rt.processes() == {}
    with pytest.raises(ValueError, match="unknown node 'good'"):
        await rt.kill("good")


async def test_cancelled_start_leaves_nothing() -> None:
    """Ctrl-C while nodes are still starting: the runtime ends what it had started."""
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    rt = LocalRuntime()
    task = asyncio.ensure_future(rt.start([node("a", marker), node("b", marker)]))
    await wait_until(lambda: len(processes_with(marker)) == 2 or task.done(),
                     "both node processes", every_s=0.05)
    assert len(processes_with(marker)) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert processes_with(marker) == []


async def test_bad_launches_are_refused() -> None:
    rt = LocalRuntime()
    with pytest.raises(ValueError, match="no nodes to start"):
        await rt.start([])
    marker = "unused"
    with pytest.raises(ValueError, match=r"node name\(s\) given twice: a"):
        await rt.start([node("a", marker), node("a", marker)])
