"""What the runtimes that run node processes on this host share (`local`, `netns`): one process
group per node, started low-priority until it listens, killed and revived by its id, and the
helpers that find, end and re-prioritise exactly those processes.

A starting node imports and builds a lot; on a small host that CPU comes from the running nodes
and shows up as their lateness. So a node starts at nice `STARTING_NICE` and is put back to
the runtime's own priority as soon as it listens, every thread of it (Linux sets priority per
thread). Raising a priority back needs CAP_SYS_NICE, so without it nodes start at normal
priority (a node left at low priority would distort the run).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from netem.probe import has_capability
from netem.virtual import clock_held
from netem.virtual import current as clock_authority
from orchestrator.mesh.lifetime import together
from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    Runtime,
    RuntimeFailure,
    node_named,
    wait_listening,
)

__all__ = ["STARTING_NICE", "NodeProcess", "ProcessNode", "ProcessRuntime", "can_renice",
           "end_process", "preexec", "restore_priority", "starting_nice"]

STARTING_NICE = 10
T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_CAP_SYS_NICE = 23


class NodeProcess(Protocol):
    """What a runtime uses of a node's process: asyncio's Process or a forked one."""

    pid: int
    returncode: int | None

    async def wait(self) -> int: ...


def can_renice() -> bool:
    """Whether this process may raise a priority back (CAP_SYS_NICE)."""
    return has_capability(_CAP_SYS_NICE)


def starting_nice() -> int:
    """The nice increment a starting node gets here (0 where it could not be undone)."""
    return STARTING_NICE if can_renice() else 0


def restore_priority(pid: int) -> None:
    """Every thread of `pid` back to this process's own priority (after it listens)."""
    if not can_renice():
        return
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that just ended
            os.setpriority(os.PRIO_PROCESS, int(tid), mine)


def preexec(nice: int = 0) -> Callable[[], None] | None:
    """A preexec function: die with this process (PR_SET_PDEATHSIG=SIGKILL, resolved before
    the fork) and lower the priority by `nice`."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        prctl = None

    def run() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if nice:
            os.nice(nice)

    return run


async def end_process(proc: NodeProcess | None, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL after grace_s; reap it, and whatever else the node
    started in its group goes with it."""
    if proc is None or proc.returncode is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            async with asyncio.timeout(wait_s):
                await proc.wait()
            break
        except TimeoutError:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _clock_exit(name: str) -> None:
    """Tell the run's virtual clock, if any, that this node ends on purpose."""
    authority = clock_authority()
    if authority is not None:
        authority.expect_exit(name)


@dataclass
class ProcessNode:
    """One node of a process runtime: its launch, where it listens, log and process."""

    launch: NodeLaunch
    address: str
    port: int
    log: Path | None = None
    proc: NodeProcess | None = None
    start_ticks: int | None = None


class ProcessRuntime(Runtime):
    """Node table, kill / revive / running / logs, readiness and ending, for runtimes whose
    nodes are processes of this host. Subclasses say how a node is spawned and reached."""

    ready_timeout_s: float
    stop_grace_s: float

    def __init__(self) -> None:
        self._nodes: dict[str, ProcessNode] = {}

    @abc.abstractmethod
    async def _spawn(self, node: ProcessNode) -> None:
        """Start the node's process (node.proc), not waiting for it to listen."""

    @abc.abstractmethod
    def endpoints(self) -> dict[str, Endpoint]:
        """Node → Endpoint of every node."""

    def processes(self) -> dict[str, tuple[int, int | None]]:
        """Node → (pid, start ticks) of its running process (what a state file records)."""
        return {name: (n.proc.pid, n.start_ticks) for name, n in self._nodes.items()
                if n.proc is not None and n.proc.returncode is None}

    async def kill(self, name: str) -> None:
        """node-down: SIGKILL the node's process group (a crash); `revive` starts it again."""
        node = self._node(name)
        _clock_exit(name)
        with clock_held(f"node-down {name}: its process is reaped"):
            await end_process(node.proc, grace_s=0.0)

    async def revive(self, name: str) -> Endpoint:
        """node-up: start the node again where it was and wait until it listens."""
        node = self._node(name)
        if node.proc is None or node.proc.returncode is not None:
            await self._start(node)
            try:
                await self._ready(node)
            except BaseException:
                _clock_exit(name)
                await end_process(node.proc, grace_s=0.0)
                raise
        return self.endpoints()[name]

    async def _start(self, node: ProcessNode) -> None:
        """Spawn the node; a run on a virtual clock waits for it to join (netem.virtual)."""
        authority = clock_authority()
        if authority is not None:
            authority.expect(node.launch.name)
        try:
            await self._spawn(node)
        except BaseException:
            _clock_exit(node.launch.name)
            raise

    async def running(self, name: str) -> bool:
        proc = self._node(name).proc
        return proc is not None and proc.returncode is None

    async def logs(self, name: str, lines: int = 30) -> str:
        self._node(name)
        return self.log_tail(name, lines)

    def log_path(self, name: str) -> Path | None:
        """The node's log file (appended to across revivals), for a supervisor to keep."""
        node = self._nodes.get(name)
        return None if node is None else node.log

    def log_tail(self, name: str, lines: int = 20) -> str:
        node = self._nodes.get(name)
        if node is None or node.log is None or not node.log.exists():
            return ""
        return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])

    def _node(self, name: str) -> ProcessNode:
        return node_named(self._nodes, name)

    async def _ready(self, node: ProcessNode) -> None:
        """Wait until the node listens (or its process ends), then give it its priority."""
        proc = node.proc
        try:
            await wait_listening(node.address, node.port, timeout_s=self.ready_timeout_s,
                                 alive=lambda: proc is not None and proc.returncode is None)
        except (TimeoutError, RuntimeFailure) as exc:
            _clock_exit(node.launch.name)
            raise RuntimeFailure(
                f"node {node.launch.name} did not start ({exc}); its log ends with:\n"
                f"{self.log_tail(node.launch.name)}") from None
        if proc is not None:
            restore_priority(proc.pid)

    async def _end_all(self) -> None:
        """End every node's process group at once; one that cannot be ended does not stop the
        others (a RuntimeFailure names it after all are done)."""
        errors: list[str] = []
        for name in self._nodes:
            _clock_exit(name)

        async def end(node: ProcessNode) -> None:
            try:
                await end_process(node.proc, self.stop_grace_s)
            except OSError as exc:
                errors.append(f"node {node.launch.name}: {exc}")

        await together(*(end(n) for n in self._nodes.values()))
        if errors:
            raise RuntimeFailure(f"could not end: {'; '.join(errors)}")
