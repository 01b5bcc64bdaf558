"""Watch a live mesh's nodes while an arm runs: a node that exits, or stops answering, with no
fault scheduled is a death the run must know about.

Without it a crashed node's failures are charged to the policy being measured and its log is
deleted with the runtime's temporary folder. `Supervisor` polls every node (`every_s`): the
runtime says whether its process or container still runs (`Runtime.running`), and
`GET /v1/health` whether it answers. A node the mesh took down itself (a `node-down` fault:
`LiveMesh.down`) is not watched until it is back. A death is

* "exited": the runtime says the node no longer runs (e.g. `kill -9`, an OOM kill, a crash);
* "stopped answering": the process runs but no health answer came for `silent_s` (a hung
  loop, SIGSTOP); the supervisor then kills it, so that its log stops where it hung.

Either way the node's log is copied into `logs_dir` (the run's output folder), the death is
recorded (`deaths`, run.json `node_deaths`) and the node is marked down in the mesh, so the
next `reset` restarts it: the run goes on, and the report marks the arm not faithful from the
moment of the death (`experiments.analysis.faithful`). Runtime hooks used: `running(name)`, and
`log_path(name)` (process runtimes) or `logs(name, lines)` (containers) for the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netem.timing import now
from orchestrator.mesh.lifetime import together
from orchestrator.runclock import REAL, RunClock
from services.errors import NodeError

__all__ = ["Death", "Supervisor", "runtime_notes", "supervise"]

EVERY_S = 0.5  # a poll of every node (wall seconds)
SILENT_S = 30.0  # no health answer for this long (wall seconds x time dilation): hung
HEALTH_S = 5.0  # one health call's limit
LOG_LINES = 100_000  # a container's log, read back through the engine


@dataclass(frozen=True)
class Death:
    """One node that died with no fault scheduled. `at` is `netem.timing.now()` seconds;
    `log` the copy of its log, relative to the output folder ("" when none could be read)."""

    node: str
    at: float
    how: str
    log: str = ""

    def to_json(self, start: float, run_clock: RunClock = REAL) -> dict[str, Any]:
        """For run.json: `at_s` in scenario seconds since the arm's workload start."""
        return {"node": self.node, "at_s": round(run_clock.since(start, self.at), 3),
                "how": self.how,
                "log": self.log}


class Supervisor:
    """Polls a `LiveMesh`'s nodes (see the module docstring). Use through `supervise`."""

    def __init__(self, mesh: Any, logs_dir: Path | None, *, run_clock: RunClock = REAL,
                 every_s: float = EVERY_S, silent_s: float = SILENT_S) -> None:
        self.mesh = mesh
        self.launcher = getattr(mesh, "launcher", None)
        self.logs_dir = logs_dir
        self.every_s = every_s
        self.silent_s = run_clock.to_wall_s(silent_s)
        self.deaths: list[Death] = []
        self._answered: dict[str, float] = {}

    @property
    def can_watch(self) -> bool:
        return self.launcher is not None and hasattr(self.launcher, "running")

    def _scheduled_down(self, name: str) -> bool:
        return name in getattr(self.mesh, "down", ())

    async def run(self) -> None:
        """Poll until cancelled."""
        start = now()
        for name in self.mesh.urls:
            self._answered[name] = start
        while True:
            await asyncio.sleep(self.every_s)
            await together(*(self.check(name) for name in list(self.mesh.urls)))

    async def check(self, name: str) -> Death | None:
        """One look at one node; returns the death it found, if any."""
        if self._scheduled_down(name):
            self._answered[name] = now()
            return None
        running = await self.launcher.running(name)
        if self._scheduled_down(name):  # taken down by a fault while we asked
            return None
        if not running:
            return await self._died(name, "exited (no fault scheduled)")
        try:
            async with asyncio.timeout(HEALTH_S):
                await self.mesh.client.health(self.mesh.urls[name])
            self._answered[name] = now()
        except (NodeError, TimeoutError, OSError):
            silent = now() - self._answered.get(name, now())
            if silent >= self.silent_s and not self._scheduled_down(name):
                with contextlib.suppress(OSError, RuntimeError):
                    await self.launcher.kill(name)
                return await self._died(name, f"stopped answering for {silent:.0f} s "
                                              "(killed by the supervisor)")
        return None

    async def _died(self, name: str, how: str) -> Death:
        at = now()
        self.mesh.down.add(name)  # the next reset starts it again
        death = Death(name, at, how, await self._keep_log(name))
        self.deaths.append(death)
        return death

    async def _keep_log(self, name: str) -> str:
        """Copy the node's whole log into logs_dir; its path relative to the output folder."""
        if self.logs_dir is None:
            return ""
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        dest = self.logs_dir / f"{name}.log"
        path = getattr(self.launcher, "log_path", lambda _n: None)(name)
        try:
            if path is not None and Path(path).exists():
                shutil.copyfile(path, dest)
            elif hasattr(self.launcher, "logs"):
                dest.write_text(await self.launcher.logs(name, LOG_LINES))
            else:
                return ""
        except (OSError, NodeError, RuntimeError):
            return ""
        return f"{self.logs_dir.name}/{dest.name}"


@contextlib.asynccontextmanager
async def supervise(mesh: Any, logs_dir: Path | None, *, run_clock: RunClock = REAL,
                    every_s: float = EVERY_S, silent_s: float = SILENT_S
                    ) -> AsyncIterator[Supervisor]:
    """Watch `mesh`'s nodes for the block's length (nothing for a target without a runtime)."""
    sup = Supervisor(mesh, logs_dir, run_clock=run_clock, every_s=every_s, silent_s=silent_s)
    if not sup.can_watch:
        yield sup
        return
    task = asyncio.create_task(sup.run(), name="supervisor")
    try:
        yield sup
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def runtime_notes(launcher: Any) -> list[str]:
    """What a runtime noted while it ran, as lines for run.json's `runtime_notes`: its
    `notes` (Swarm: nodes on several hosts, a service without NET_ADMIN) and how each node
    went down and came back (Swarm's `fault_times`: a container killed or a service scaled
    to 0, and how long it took)."""
    out = [str(n) for n in getattr(launcher, "notes", None) or ()]
    for name, records in (getattr(launcher, "fault_times", None) or {}).items():
        out += [f"node {name} {r.get('state')}: {r.get('how')} ({r.get('seconds')} s)"
                for r in records if isinstance(r, dict)]
    return out
