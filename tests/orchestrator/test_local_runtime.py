"""The local runtime: real node processes on loopback, exec'd or forked from the template,
killed and revived, and nothing left behind after stop, a failed start, a cancelled one
(Ctrl-C) or the owner's death. Processes are looked for in /proc by a marker in their command
line, not through the runtime under test."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure, wait_listening
from orchestrator.runtimes.forkserver import forkable
from orchestrator.runtimes.local import LocalRuntime, process_alive
from orchestrator.runtimes.processes import can_renice
from services.client import ClientSettings, NodeClient
from services.errors import NodeUnreachable
from tests.helpers import ROOT, env, processes_with, wait_gone, wait_until

pytestmark = pytest.mark.slow
TOKEN = "local-runtime-test"


def node(name: str, marker: str) -> NodeLaunch:
    """A modeled tiny-moe node; `marker` rides in its command line (an unused state folder)."""
    argv = (sys.executable, "-m", "services", "node", "--name", "{name}", "--host", "{address}",
            "--port", "{port}", "--model", "tiny-moe", "--compute", "modeled",
            "--state-dir", f"/nonexistent/{marker}-{name}")
    return NodeLaunch(name, argv, env={"MOEMESH_TOKEN": TOKEN})


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "exec"])
async def test_start_kill_revive_stop_leaves_nothing(fork: bool) -> None:
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    async with NodeClient(ClientSettings(token=TOKEN, control_s=10)) as client:
        async with LocalRuntime(fork_server=fork) as rt:
            eps = await rt.start([node("a", marker), node("b", marker)])
            assert rt.spawn_mode == ("fork" if fork else "exec")
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
    """Ctrl-C while nodes are still starting: the runtime ends what it had started. Node b
    never listens, so the start is surely still waiting when it is cancelled (two real nodes
    forked from the template can both be ready before the test sees them)."""
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    rt = LocalRuntime(ready_timeout_s=120)
    silent = NodeLaunch("b", (sys.executable, "-c", f"import time; time.sleep(300)  # {marker}"))
    assert forkable(silent.argv)
    task = asyncio.ensure_future(rt.start([node("a", marker), silent]))
    await wait_until(lambda: len(processes_with(marker)) == 2 or task.done(),
                     "both node processes", every_s=0.05)
    assert len(processes_with(marker)) == 2
    template = rt.template_pid
    assert template is not None  # the nodes were forked from it
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert processes_with(marker) == []
    assert not process_alive(template, None)


async def test_a_cancelled_readiness_wait_is_cancelled_whenever_it_comes() -> None:
    """Ctrl-C must end the wait for a port at once, even when it lands just as a connection
    attempt is refused: `asyncio.wait_for` on Python 3.11 then handed back the refusal and lost
    the cancellation, and the start waited out the node's whole readiness timeout (16 of 300
    cancels here before the fix)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: every attempt is refused at once
    rng = random.Random(7)
    for _ in range(200):
        task = asyncio.ensure_future(wait_listening("127.0.0.1", port, timeout_s=30))
        await asyncio.sleep(rng.random() * 0.004)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5)


async def test_bad_launches_are_refused() -> None:
    rt = LocalRuntime()
    with pytest.raises(ValueError, match="no nodes to start"):
        await rt.start([])
    marker = "unused"
    with pytest.raises(ValueError, match=r"node name\(s\) given twice: a"):
        await rt.start([node("a", marker), node("a", marker)])


SERVER = str(ROOT / "tests" / "netem" / "aiohttp_node.py")


async def test_a_forked_node_is_a_process_of_its_own(tmp_path: Path) -> None:
    """Its own pid, session and command line (what ps shows), this process's priority once it
    listens; a forked process gets its environment and working directory, and its exit code
    is reported."""
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    launch = NodeLaunch("s1", (sys.executable, SERVER, "{name}", "{port}", marker),
                        env={"MARK": marker})
    quits = NodeLaunch("q1", (sys.executable, "-c", "import os, sys; print(os.getcwd(), "
                              "os.environ['MARK']); sys.exit(3)"), env={"MARK": marker})
    assert forkable(launch.argv) and forkable(quits.argv)
    async with LocalRuntime(fork_server=True) as rt:
        eps = await rt.start([launch])
        assert rt.spawn_mode == "fork"
        pid = rt.processes()["s1"][0]
        async with aiohttp.ClientSession() as session, session.get(eps["s1"].url) as resp:
            assert (await resp.json()) == {"name": "s1", "pid": pid, "netns": None}
        assert processes_with(marker) == [pid]
        assert os.getsid(pid) == os.getpgid(pid) == pid != os.getpid()
        assert os.getppid() != pid and rt.template_pid not in (None, os.getpid(), pid)
        if can_renice():  # started at low priority, back to ours once it listened
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.getpriority(os.PRIO_PROCESS, int(tid)) == mine
        proc = await rt._forks.spawn(quits.argv, env={"MARK": marker}, log=tmp_path / "q.log",
                                     cwd=str(tmp_path))
        assert await asyncio.wait_for(proc.wait(), 30) == 3
        assert (tmp_path / "q.log").read_text().split() == [str(tmp_path), marker]
    assert processes_with(marker) == []


async def test_the_owner_killed_takes_template_and_nodes_with_it(tmp_path: Path) -> None:
    """SIGKILL to the process holding the runtime (no clean-up runs): its template dies
    with it (parent-death signal), and the forked nodes with the template."""
    marker = f"mm-{uuid.uuid4().hex[:10]}"
    script = tmp_path / "hold.py"
    script.write_text(
        "import asyncio, json, sys\n"
        "from orchestrator.runtimes.base import NodeLaunch\n"
        "from orchestrator.runtimes.local import LocalRuntime\n"
        "async def main():\n"
        "    async with LocalRuntime() as rt:\n"
        f"        await rt.start([NodeLaunch(n, (sys.executable, {SERVER!r}, '{{name}}', "
        f"'{{port}}', {marker!r})) for n in ('h1', 'h2')])\n"
        "        print(json.dumps([rt.template_pid, *(p for p, _ in "
        "rt.processes().values())]), flush=True)\n"
        "        await asyncio.sleep(120)\n"
        "asyncio.run(main())\n")
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), env=env(),
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        pids = json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))
        assert len(pids) == 3 and len(processes_with(marker)) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert await asyncio.to_thread(wait_gone, marker) == []
    # a dying process loses its command line before it is gone: wait for the pids themselves
    await wait_until(lambda: not any(process_alive(pid, None) for pid in pids),
                     "the template and its nodes to be gone", timeout_s=15, every_s=0.05)
    # no clean-up ran, so its log folder is left: `moemesh clean` finds it as the dead
    # owner's and removes it (and the test leaves nothing in /tmp)
    from orchestrator import clean

    left = [x for x in clean.find().leftovers
            if x.kind == "folder" and f"(pid {proc.pid})" in x.why]
    assert len(left) == 1 and Path(left[0].name).is_dir()
    assert clean.remove(left) == [] and not Path(left[0].name).exists()


def test_a_port_the_kernel_hands_out_again_is_not_given_to_a_second_node(monkeypatch) -> None:
    """Nodes come up together, and a probe's port is free again once the probe closes, so the
    kernel may offer it twice (CI saw edge1 and edge2 on one port). Which port bind(0) returns
    cannot be forced, so this replaces the socket with a double that offers 40001 twice."""
    import orchestrator.runtimes.local as local

    offered = iter([40001, 40001, 40002])

    class Probe:
        def __enter__(self) -> Probe:
            self.port = next(offered)
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local.socket, "socket", lambda *a: Probe())
    assert local._free_port(set()) == 40001
    assert local._free_port({40001}) == 40002
