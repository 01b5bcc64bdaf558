"""The Runtime interface: what makes a described mesh of nodes live, and takes it down again.

A runtime starts one process per node (`NodeLaunch`), waits until each listens, and returns the
`Endpoint`s by node name. It owns everything it created (processes, namespaces, containers) and
releases exactly that, by id, on `stop()`: after success, after an error half-way through start,
and on Ctrl-C (use it as `async with runtime: ...`). Runtimes: `local` (processes on loopback),
`netns` (network namespaces on a bridge, `orchestrator.runtimes.netns`), `docker` (containers).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

from moe.vocab import is_number
from orchestrator.mesh.lifetime import to_the_end

__all__ = ["Endpoint", "NodeLaunch", "Runtime", "RuntimeFailure", "check_launches",
           "node_named", "wait_listening"]

T = TypeVar("T")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class RuntimeFailure(RuntimeError):
    """A node could not be started or stopped; the message names the node and why."""


@dataclass(frozen=True)
class NodeLaunch:
    """One node to start: its name and the command line of its process.

    In argv, "{name}", "{port}" and "{address}" are replaced by the node's values (the address
    is the one its peers reach it at), e.g. ("moemesh", "node", "--name", "{name}", "--port",
    "{port}").
    """

    name: str
    argv: tuple[str, ...]
    port: int = 8080
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"node name {self.name!r} must be 1-31 lower-case letters, digits or '-'"
            )
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"node {self.name}: argv must be a non-empty list of strings")
        object.__setattr__(self, "argv", tuple(self.argv))
        if not is_number(self.port, integer=True) or not 1 <= self.port <= 65535:
            raise ValueError(f"node {self.name}: port must be 1..65535, got {self.port!r}")

    def command(self, address: str, port: int | None = None) -> list[str]:
        """argv with the placeholders filled in; nothing else in it is read (a device profile
        given as JSON keeps its braces, which str.format would take for fields)."""
        values = {"{name}": self.name, "{port}": str(port or self.port), "{address}": address}
        out = []
        for arg in self.argv:
            for key, value in values.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out


@dataclass(frozen=True)
class Endpoint:
    """Where a started node is.

    host/port: reachable from the orchestrator (this process). address: the node's own address
    as its peers see it (what tc filters match). netns/iface: where the node's egress is
    shaped (None when it is this process's namespace or unknown).
    """

    name: str
    host: str
    port: int
    address: str
    netns: str | None = None
    iface: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def node_named(nodes: Mapping[str, T], name: str) -> T:
    """The runtime's node called `name`; a ValueError that lists the ones it runs."""
    node = nodes.get(name)
    if node is None:
        known = ", ".join(nodes) or "none"
        raise ValueError(f"unknown node {name!r} (this runtime runs: {known})")
    return node


def check_launches(nodes: Sequence[NodeLaunch]) -> None:
    """Refuse an empty list or a name given twice (before anything is created)."""
    if not nodes:
        raise ValueError("no nodes to start")
    names = [n.name for n in nodes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"node name(s) given twice: {', '.join(dupes)}")


class Runtime(abc.ABC):
    """Start nodes, hand out their endpoints, stop them; usable as an async context manager."""

    name: str = "runtime"

    @abc.abstractmethod
    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        """Start every node; return when each listens. On failure, undo and raise."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release everything this runtime created. Idempotent; never raises for 'gone'."""

    @abc.abstractmethod
    async def kill(self, name: str) -> None:
        """Kill one node's process hard (a crash, for fault injection)."""

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await to_the_end(self.stop())  # a cancelled parent (Ctrl-C) cannot cut it short


async def wait_listening(host: str, port: int, *, timeout_s: float, alive: object = None) -> None:
    """Return once host:port accepts a TCP connection; TimeoutError after timeout_s.

    alive: optional callable returning False once the process is gone (stops the wait early
    with RuntimeFailure).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if callable(alive) and not alive():
            raise RuntimeFailure(f"process for {host}:{port} exited before it listened")
        try:
            async with asyncio.timeout(1.0):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            if loop.time() >= deadline:
                raise TimeoutError(f"{host}:{port} did not listen within {timeout_s:g} s") from None
            await asyncio.sleep(0.05)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
