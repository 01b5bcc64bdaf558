"""The netns runtime on this host: real namespaces, a real bridge, real server processes.

The ones marked `netns` need root, iproute2 and, where bridged traffic is filtered, iptables
(CI installs them and sets MOEMESH_NETNS_REQUIRED=1). The conftest checks after every test that
no namespace or interface of ours is left; these tests also check processes.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest

from orchestrator.runtimes.base import Endpoint, NodeLaunch, Runtime, RuntimeFailure
from orchestrator.runtimes.netns import NetnsRuntime
from tests.helpers import alive, env, wait_until

SERVER = str(Path(__file__).with_name("aiohttp_node.py"))


def aiohttp_node(name: str) -> NodeLaunch:
    return NodeLaunch(name, (sys.executable, SERVER, "{name}", "{port}"), port=8080)


@pytest.mark.netns
async def test_three_nodes_serve_and_reach_each_other(kernel: SimpleNamespace) -> None:
    async with NetnsRuntime() as rt:
        assert isinstance(rt, Runtime)
        eps = await rt.start([aiohttp_node(n) for n in ("n1", "n2", "n3")])
        assert set(eps) == {"n1", "n2", "n3"}
        assert all(isinstance(e, Endpoint) and e.iface == "eth0" for e in eps.values())
        assert len({e.address for e in eps.values()}) == 3
        assert {e.netns for e in eps.values()} <= kernel.netns_list()  # iproute2 sees them
        pids = []
        async with aiohttp.ClientSession() as session:
            for name, ep in eps.items():
                async with session.get(ep.url + "/") as resp:
                    body = await resp.json()
                assert body["name"] == name and body["netns"] == ep.netns
                pids.append(body["pid"])
            # n1 fetches n3 from inside its own namespace, over the bridge
            url = f"{eps['n1'].url}/fetch?url=http://{eps['n3'].address}:8080/"
            async with session.get(url) as resp:
                assert (await resp.json())["name"] == "n3"
        namespaces = rt.namespaces
    assert not set(namespaces) & kernel.netns_list()
    assert not kernel.links_named(f"mmb{rt.id}") and not kernel.links_named(f"mmv{rt.id}")
    assert not any(alive(pid) for pid in pids)


@pytest.mark.netns
async def test_kill_takes_one_node_down_and_revive_brings_it_back() -> None:
    async with NetnsRuntime() as rt:
        eps = await rt.start([aiohttp_node("n1"), aiohttp_node("n2")])
        await rt.kill("n1")
        assert not await rt.running("n1") and await rt.running("n2")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get(eps["n1"].url + "/")
            async with session.get(eps["n2"].url + "/") as resp:
                assert (await resp.json())["name"] == "n2"
            assert await rt.revive("n1") == eps["n1"]
            async with session.get(eps["n1"].url + "/") as resp:
                assert (await resp.json())["name"] == "n1"
        with pytest.raises(ValueError, match="unknown node 'n9' \\(this runtime runs: n1, n2\\)"):
            await rt.kill("n9")


@pytest.mark.netns
async def test_a_node_that_fails_to_start_is_reported_and_everything_is_undone(
    kernel: SimpleNamespace,
) -> None:
    broken = NodeLaunch("bad", (sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"))
    rt = NetnsRuntime(ready_timeout_s=20)
    with pytest.raises(RuntimeFailure, match="node bad did not start") as err:
        await rt.start([aiohttp_node("good"), broken])
    assert "boom" in str(err.value)  # its log tail is in the message
    assert not rt.namespaces
    assert f"mm-{rt.id}-good" not in kernel.netns_list()


@pytest.mark.netns
async def test_cancelling_start_cleans_up_like_ctrl_c(kernel: SimpleNamespace) -> None:
    """Cancelled while its node runs and is waited for: the node and namespace go. Every
    step is a bounded command, so a start that cannot proceed ends the wait with its error
    (task.result() raises it) instead of hanging."""
    slow = NodeLaunch("slow", (sys.executable, "-c", "import time; time.sleep(60)"))
    rt = NetnsRuntime(ready_timeout_s=60)
    task = asyncio.ensure_future(rt.start([slow]))
    await wait_until(lambda: "slow" in rt.processes() or task.done(), "the node's process")
    if task.done():
        task.result()
    (pid, _), = rt.processes().values()
    assert f"mm-{rt.id}-slow" in kernel.netns_list()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    assert not rt.namespaces and f"mm-{rt.id}-slow" not in kernel.netns_list()
    assert not alive(pid)


@pytest.mark.netns
async def test_sigint_to_a_runtime_process_tears_it_down(
    tmp_path: Path, kernel: SimpleNamespace,
) -> None:
    """Ctrl-C on a program that holds a runtime: the namespaces go with it."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import asyncio, sys\n"
        "from orchestrator.runtimes.netns import NetnsRuntime\n"
        "from orchestrator.runtimes.base import NodeLaunch\n"
        "async def main():\n"
        "    async with NetnsRuntime() as rt:\n"
        f"        await rt.start([NodeLaunch('h1', (sys.executable, {SERVER!r}, '{{name}}',"
        " '{port}'))])\n"
        "        print('READY', rt.id, flush=True)\n"
        "        await asyncio.sleep(60)\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "except KeyboardInterrupt:\n"
        "    print('INTERRUPTED', flush=True)\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script), env=env(),
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert line.startswith("READY"), line
    rid = line.split()[1]
    assert f"mm-{rid}-h1" in kernel.netns_list()
    proc.send_signal(signal.SIGINT)
    rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
    assert await proc.wait() == 0 and "INTERRUPTED" in rest
    assert f"mm-{rid}-h1" not in kernel.netns_list()
    assert not kernel.links_named(f"mmb{rid}")


def test_bad_launches_are_refused() -> None:
    with pytest.raises(ValueError, match="node name 'N 1' must be"):
        NodeLaunch("N 1", ("x",))
    with pytest.raises(ValueError, match=r"port must be 1\.\.65535, got 0"):
        NodeLaunch("n1", ("x",), port=0)
    with pytest.raises(ValueError, match=r"subnet '10\.0\.0\.0/31' is too small"):
        NetnsRuntime(subnet="10.0.0.0/31")


async def test_duplicate_names_are_refused_before_anything_is_made() -> None:
    rt = NetnsRuntime()
    with pytest.raises(ValueError, match="node name\\(s\\) given twice: n1"):
        await rt.start([aiohttp_node("n1"), aiohttp_node("n1")])
    assert not rt.namespaces


def test_missing_prerequisites_fail_at_once_and_create_nothing(tmp_path: Path) -> None:
    """Without `ip` (PATH has none) start() fails within a second, before anything exists,
    with the part and its fix on one line; no root needed to see it."""
    script = ("import asyncio, sys, time\n"
              "from orchestrator.runtimes.base import NodeLaunch, RuntimeFailure\n"
              "from orchestrator.runtimes.netns import NetnsRuntime\n"
              "rt = NetnsRuntime()\n"
              "t = time.monotonic()\n"
              "try:\n"
              "    asyncio.run(rt.start([NodeLaunch('n1', ('true',))]))\n"
              "except RuntimeFailure as exc:\n"
              "    print(f'{time.monotonic() - t:.3f}', exc, rt.namespaces, rt.log_dir)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env(PATH=str(tmp_path)),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seconds, message = done.stdout.split(" ", 1)
    assert float(seconds) < 1.0
    assert "the netns runtime cannot run here" in message and "ip (iproute2)" in message
    assert "fix: apt-get install -y iproute2" in message
    assert message.strip().endswith("[] None") and "\n" not in message.strip()
