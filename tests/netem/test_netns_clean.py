"""`moemesh clean` after a netns run killed with SIGKILL: every namespace, veth, bridge,
iptables rule, process and folder of that run goes, by its marker and id; nothing else does.

The run is a real NetnsRuntime in a child process (two real nodes), killed with `kill -9`
mid-run, so its `stop()` never runs. A process left running inside one of its namespaces
stands for a node that outlived its run (the nodes themselves die with their parent); a
namespace named like ours but that no marker names stands for what is not this run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.clean import find
from tests.helpers import ROOT, moemesh

SERVER = str(Path(__file__).with_name("aiohttp_node.py"))

RUN = textwrap.dedent(f"""\
    import asyncio, sys
    from orchestrator.runtimes.base import NodeLaunch
    from orchestrator.runtimes.netns import NetnsRuntime

    async def main():
        rt = NetnsRuntime()
        await rt.start([NodeLaunch(n, (sys.executable, {SERVER!r}, "{{name}}", "{{port}}"),
                                   port=8080) for n in ("n1", "n2")])
        print(rt.id, rt.bridge, str(rt.log_dir), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False).stdout


def _objects(rid: str) -> dict[str, list[str]]:
    links = [lk["ifname"] for lk in json.loads(_ip("-j", "link", "show") or "[]")]
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True,
                           check=False).stdout.splitlines()
    return {"netns": sorted(n.split()[0] for n in _ip("netns", "list").splitlines()
                            if n.startswith(f"mm-{rid}-")),
            "links": sorted(n for n in links if n.startswith((f"mmv{rid}", f"mmb{rid}"))),
            "rules": [r for r in rules if f"mmb{rid}" in r]}


@pytest.mark.netns
def test_clean_after_a_kill_9_removes_what_that_run_made_and_nothing_else(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, "-c", RUN], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    decoy = "mm-decafe-x"  # named like ours; no marker names its id
    outlived = None
    try:
        assert run.stdout is not None
        line = run.stdout.readline().split()
        assert len(line) == 3, run.stderr.read() if run.stderr else ""
        rid, bridge, log_dir = line
        os.kill(run.pid, signal.SIGKILL)  # its stop() never runs
        run.wait(10)
        subprocess.run(["ip", "netns", "add", decoy], check=True)
        outlived = subprocess.Popen(["ip", "netns", "exec", f"mm-{rid}-n1", "sleep", "300"])
        time.sleep(0.5)
        left = _objects(rid)
        assert left["netns"] == [f"mm-{rid}-n1", f"mm-{rid}-n2"]
        assert bridge in left["links"] and len(left["links"]) == 3  # bridge + two veths
        assert len(left["rules"]) == (
            1 if Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip()
            == "1" else 0)
        assert Path(log_dir).is_dir()

        found = find()
        mine = {(x.kind, x.name) for x in found.leftovers if x.run_id == rid}
        assert {("netns", n) for n in left["netns"]} <= mine
        assert {("folder", log_dir), ("process", str(outlived.pid))} <= mine
        assert any(k.startswith(f"netns {decoy}") for k in found.kept)
        assert moemesh("doctor") == 0
        assert f"mm-{rid}-n1" in capsys.readouterr().out  # doctor reports it

        assert moemesh("clean") == 0
        out = capsys.readouterr().out
        assert f"removed netns     mm-{rid}-n1" in out and f"left alone: netns {decoy}" in out
        assert _objects(rid) == {"netns": [], "links": [], "rules": []}
        assert not Path(log_dir).exists()
        assert outlived.wait(10) is not None
        assert decoy in _ip("netns", "list")  # not this run's: still there
        assert moemesh("clean", "--dry-run") == 0
        assert f"run {rid}" not in capsys.readouterr().out
    finally:
        run.kill()
        run.communicate()
        if outlived is not None:
            outlived.kill()
            outlived.wait()
        subprocess.run(["ip", "netns", "del", decoy], check=False, capture_output=True)
