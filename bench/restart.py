"""`moemesh bench restart`: how long a node of the local runtime takes to come back after a
crash, started by exec (a fresh interpreter imports torch and the project) and forked from the
runtime's template process, in the same run.

Per mode: a LocalRuntime starts two real tiny-moe nodes (`moemesh node`, real compute), then
`--restarts` times kills node a (SIGKILL, node-down), revives it (node-up) and waits until it
answers GET /v1/health. Reported: the restart time (kill → health answered) p50 and max, and
the CPU time the new process spent until then (what a restart takes from the running nodes on
a small host); the headline is the ratio of the exec p50 to the fork p50 (issue 12's target:
a restart ready in ≤ 1 s).

    python -m bench.restart [--json] [--restarts N]      (also: moemesh bench restart)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .commands import standalone

__all__ = ["add_arguments", "command", "main", "run_bench"]

TARGET_S = 1.0
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _cpu_ms(pid: int) -> float:
    """user + system CPU time of the process so far (/proc/PID/stat fields 14 and 15)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


async def _mode(fork: bool, restarts: int, work: Path) -> dict[str, Any]:
    from orchestrator.runtimes.base import NodeLaunch
    from orchestrator.runtimes.local import LocalRuntime
    from services.client import ClientSettings, NodeClient

    token = secrets.token_hex(8)

    def launch(name: str) -> NodeLaunch:
        return NodeLaunch(name, (sys.executable, "-m", "orchestrator.cli", "node", "--name",
                                 "{name}", "--host", "{address}", "--port", "{port}", "--model",
                                 "tiny-moe", "--state-dir", str(work / f"{name}-{fork}")),
                          env={"MOEMESH_TOKEN": token})

    times, cpu = [], []
    async with NodeClient(ClientSettings(token=token, control_s=10)) as client, \
            LocalRuntime(fork_server=fork) as rt:
        t0 = time.perf_counter()
        await rt.start([launch("a"), launch("b")])
        start_s = time.perf_counter() - t0
        mode = rt.spawn_mode
        for _ in range(restarts):
            await rt.kill("a")
            t0 = time.perf_counter()
            ep = await rt.revive("a")
            await client.health(ep.url)
            times.append(time.perf_counter() - t0)
            cpu.append(_cpu_ms(rt.processes()["a"][0]))
    return {"mode": mode, "start_s": round(start_s, 3),
            "restart_p50_s": round(statistics.median(times), 3),
            "restart_max_s": round(max(times), 3),
            "restart_cpu_ms_p50": round(statistics.median(cpu), 1),
            "restarts": [round(t, 3) for t in times]}


async def run_bench(restarts: int = 5) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moemesh-bench-restart-") as work:
        exec_ = await _mode(False, restarts, Path(work))
        fork = await _mode(True, restarts, Path(work))
    return {"exec": exec_, "fork": fork,
            "ratio_exec_to_fork": round(exec_["restart_p50_s"] / fork["restart_p50_s"], 1),
            "target_s": TARGET_S, "fork_meets_target": fork["restart_max_s"] <= TARGET_S,
            "host_cpus": os.cpu_count()}


def main(restarts: int = 5, as_json: bool = False) -> int:
    result = asyncio.run(run_bench(restarts))
    if as_json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"node restart in the local runtime (kill -> revive -> health), {restarts} restarts, "
          f"{result['host_cpus']} CPUs")
    print(f"{'mode':<6}{'first start s':>15}{'restart p50 s':>15}{'max s':>8}"
          f"{'CPU ms p50':>12}")
    for key in ("exec", "fork"):
        r = result[key]
        print(f"{r['mode']:<6}{r['start_s']:>15.3f}{r['restart_p50_s']:>15.3f}"
              f"{r['restart_max_s']:>8.3f}{r['restart_cpu_ms_p50']:>12.1f}")
    verdict = "meets" if result["fork_meets_target"] else "MISSES"
    print(f"exec/fork restart ratio: {result['ratio_exec_to_fork']}x; fork {verdict} the "
          f"{TARGET_S:g} s target (max {result['fork']['restart_max_s']:.3f} s)")
    return 0


def command(args: argparse.Namespace) -> int:
    """node restart time in the local runtime: exec vs the fork server

    Kill and revive a real tiny-moe node of the local runtime N times, once with nodes exec'd
    and once forked from the template; restart time and CPU, ratio.
    """
    return main(args.restarts, args.json)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--restarts", type=int, default=5,
                        help="kill/revive cycles per mode (default 5)")


if __name__ == "__main__":
    sys.exit(standalone("bench.restart", command, add_arguments))
