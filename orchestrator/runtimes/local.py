"""The `local` runtime: one node process per node on 127.0.0.1, no root, no namespaces.

Nodes share the host's loopback, so links are emulated by the nodes' `app` shaper (see
docs/architecture.md, Links).
Each node gets a free port of its own (kept across `kill` / `revive`, so peers' URLs stay
valid), its output goes to a log file, and it runs in a session of its own: `stop()` ends
exactly the process groups this runtime started (SIGTERM, then SIGKILL after a grace period),
by their ids. Nodes are also started with the parent-death signal set (Linux `prctl`), so if
the process owning the runtime dies without clean-up its nodes die with it.

    async with LocalRuntime() as rt:
        endpoints = await rt.start([NodeLaunch("edge1", ("python", "-m", "services", "node",
                                    "--name", "{name}", "--port", "{port}"))])
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.runtimes.base import (
    Endpoint,
    NodeLaunch,
    Runtime,
    RuntimeFailure,
    wait_listening,
)

__all__ = ["LocalRuntime", "process_alive", "process_start_ticks"]

HOST = "127.0.0.1"
PORT_TRIES = 3  # a port picked free may be taken before the node binds it: try another
_PR_SET_PDEATHSIG = 1


def _free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> object | None:
    """A preexec function that sets PR_SET_PDEATHSIG=SIGKILL (resolved before the fork)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return preexec


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None
    when it does not exist: with the pid it names one process, never a later reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Is this exact process (pid and start time) still there and not a zombie?"""
    ticks = process_start_ticks(pid)
    if ticks is None or (start_ticks is not None and ticks != start_ticks):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().decode(errors="replace")
    except OSError:
        return False
    return state[state.rfind(")") + 2:][:1] != "Z"


@dataclass
class _Node:
    launch: NodeLaunch
    port: int
    log: Path
    proc: asyncio.subprocess.Process | None = None
    start_ticks: int | None = None


class LocalRuntime(Runtime):
    """Node processes on loopback (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        *,
        ready_timeout_s: float = 120.0,
        stop_grace_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        keep_logs: bool = False,
    ) -> None:
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(env or {})
        self.keep_logs = keep_logs or log_dir is not None
        self._log_dir_given = Path(log_dir) if log_dir is not None else None
        self.log_dir: Path | None = None
        self._nodes: dict[str, _Node] = {}
        self._started = False
        self._preexec = _die_with_parent()

    # -- public -------------------------------------------------------------------------
    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        if self._started:
            raise RuntimeFailure("local runtime is already started")
        if not nodes:
            raise ValueError("no nodes to start")
        names = [n.name for n in nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node name(s) given twice: {', '.join(dupes)}")
        self._started = True
        try:
            if self._log_dir_given is not None:
                self._log_dir_given.mkdir(parents=True, exist_ok=True)
                self.log_dir = self._log_dir_given
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix="moemesh-local-"))
            for launch in nodes:
                self._nodes[launch.name] = _Node(launch, 0, self.log_dir / f"{launch.name}.log")
            tasks = [asyncio.ensure_future(self._bring_up(n)) for n in self._nodes.values()]
            try:
                await asyncio.gather(*tasks)
            finally:  # one failed or we were cancelled: the others stop waiting too
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            await asyncio.shield(self.stop())
            raise
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {name: Endpoint(name=name, host=HOST, port=n.port, address=HOST)
                for name, n in self._nodes.items()}

    def processes(self) -> dict[str, tuple[int, int | None]]:
        """Node → (pid, start ticks) of its running process (what a state file records)."""
        return {name: (n.proc.pid, n.start_ticks) for name, n in self._nodes.items()
                if n.proc is not None and n.proc.returncode is None}

    async def kill(self, name: str) -> None:
        """node-down: SIGKILL the node's process group (a crash); `revive` starts it again."""
        await _end(self._node(name).proc, grace_s=0.0)

    async def revive(self, name: str) -> Endpoint:
        """node-up: start the node again on its port and wait until it listens."""
        node = self._node(name)
        if node.proc is not None and node.proc.returncode is None:
            return self.endpoints()[name]
        await self._spawn(node)
        try:
            await self._ready(node)
        except BaseException:
            await _end(node.proc, grace_s=0.0)
            raise
        return self.endpoints()[name]

    async def running(self, name: str) -> bool:
        proc = self._node(name).proc
        return proc is not None and proc.returncode is None

    async def stop(self) -> None:
        await asyncio.gather(*(_end(n.proc, self.stop_grace_s) for n in self._nodes.values()))
        if self.log_dir is not None and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None
        self._nodes.clear()
        self._started = False

    def log_tail(self, name: str, lines: int = 20) -> str:
        node = self._nodes.get(name)
        if node is None or not node.log.exists():
            return ""
        return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])

    # -- internals ----------------------------------------------------------------------
    def _node(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            known = ", ".join(self._nodes) or "none"
            raise ValueError(f"unknown node {name!r} (this runtime runs: {known})")
        return node

    async def _bring_up(self, node: _Node) -> None:
        for attempt in range(PORT_TRIES):
            node.port = _free_port()
            await self._spawn(node)
            try:
                await self._ready(node)
                return
            except RuntimeFailure:
                gone = node.proc is not None and node.proc.returncode is not None
                if not gone or "address already in use" not in self.log_tail(
                        node.launch.name).lower() or attempt == PORT_TRIES - 1:
                    raise

    async def _spawn(self, node: _Node) -> None:
        env = {**os.environ, **self.env, **node.launch.env, "MOEMESH_NODE_NAME":
               node.launch.name}
        argv = node.launch.command(HOST, node.port)
        with open(node.log, "ab") as log:
            node.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                start_new_session=True, preexec_fn=self._preexec)
        node.start_ticks = process_start_ticks(node.proc.pid)

    async def _ready(self, node: _Node) -> None:
        proc = node.proc
        try:
            await wait_listening(HOST, node.port, timeout_s=self.ready_timeout_s,
                                 alive=lambda: proc is not None and proc.returncode is None)
        except (TimeoutError, RuntimeFailure) as exc:
            raise RuntimeFailure(
                f"node {node.launch.name} did not start ({exc}); its log ends with:\n"
                f"{self.log_tail(node.launch.name)}") from None


async def _end(proc: asyncio.subprocess.Process | None, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL after grace_s; reap it."""
    if proc is None or proc.returncode is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if sig == signal.SIGTERM and grace_s <= 0:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
            break
        except TimeoutError:
            continue
    with contextlib.suppress(ProcessLookupError):  # whatever else the node started
        os.killpg(proc.pid, signal.SIGKILL)
