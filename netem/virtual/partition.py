"""A partition: several nodes of the mesh on one event loop whose virtual clock is its own.

With one process per node, every move of the clock is a round through the authority (a wake,
an idle report, about 100 µs of the host's time and one process at a time). A partition holds
a group of nodes, each still its own aiohttp server on its own socket, in one process on one
`PartitionLoop`: when nothing in the process is left to run, the loop moves its own clock to
its earliest timer, a heap pop. With the whole mesh in one partition (`workers: 1`) the
controller is the partition: the driver, the fault timeline and every node share its loop.

The loop moves the clock only when the process is really idle, by the same rules the
authority applies across processes: nothing runnable, no thread work out (a device batch),
no bytes left to write (a full send buffer, a connect in progress) and every TCP connection
balanced, what one end sent read by the other (a byte still in the kernel would wake the loop
once it lands; the clock must not move past it meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import socket
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .authority import virtual_origin
from .loops import CountingLoop, WriterSelector
from .shared import REALTIME, VIRTUAL

__all__ = ["NODE", "PartitionClock", "PartitionLoop"]

# The node of the partition that the running code belongs to (None: the controller). Every
# task, callback and connection a node's server or its own tasks make inherit it, so that a
# crash can end exactly that node's part of the shared loop (`PartitionLoop.crash`).
NODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("moemesh_node", default=None)

_perf = time.perf_counter
STALL_S = 60.0  # wall seconds a virtual-time loop may wait for bytes or threads before it fails


class PartitionClock:
    """The partition's clock, the authority's interface for the runtimes and the runner
    (`netem.virtual.current()`): real time while processes start, virtual for the run."""

    def __init__(self) -> None:
        self.mode = REALTIME
        self._v0, self._w0 = 2.0 ** 21, _perf()  # real time counted from 2**21 s, as shared
        self.advances = 0  # clock moves in virtual time (each one event instant)
        self.virtual_s = 0.0
        self.wall_s = 0.0
        self._since = (0.0, 0.0)
        self.deaths: list[dict[str, Any]] = []

    def now(self) -> float:
        return self._v0 if self.mode == VIRTUAL else self._v0 + (_perf() - self._w0)

    @property
    def virtual(self) -> bool:
        return self.mode == VIRTUAL

    def advance(self, to: float) -> None:
        if to > self._v0:
            self._v0 = to
            self.advances += 1

    # -- the authority's interface ----------------------------------------------------------
    def go_virtual(self) -> float:
        if self.mode == VIRTUAL:
            return self._v0
        start = virtual_origin(self.now())
        self.mode, self._v0 = VIRTUAL, start
        self._since = (start, time.monotonic())
        return start

    def go_realtime(self) -> None:
        if self.mode == REALTIME:
            return
        self._account()
        self.mode, self._w0 = REALTIME, _perf()

    def _account(self) -> None:
        self.virtual_s += self._v0 - self._since[0]
        self.wall_s += time.monotonic() - self._since[1]
        self._since = (self._v0, time.monotonic())

    def stats(self) -> dict[str, Any]:
        """run.json's clock_stats (the authority's keys, and the partition's)."""
        virtual_s, wall_s = self.virtual_s, self.wall_s
        if self.mode == VIRTUAL:
            virtual_s += self._v0 - self._since[0]
            wall_s += time.monotonic() - self._since[1]
        return {"advances": self.advances, "wakes": 0, "reports": 0,
                "virtual_s": round(virtual_s, 6), "wall_s": round(wall_s, 3),
                "virtual_speedup": round(virtual_s / wall_s, 4) if wall_s > 0 else None,
                "deaths": list(self.deaths), "workers": 1, "windows": self.advances,
                "lookahead_ms": None}

    # nodes live in this process: nothing to expect or hold (the runtimes call these)
    def expect(self, name: str) -> None:
        pass

    def forget(self, name: str) -> None:
        pass

    def expect_exit(self, name: str) -> None:
        pass

    @contextlib.contextmanager
    def held(self, why: str) -> Iterator[None]:
        yield


class _Counted(socket.socket):
    """A TCP socket of the partition: what it sent and read, for the balance check."""

    _book: _Book
    _key: tuple[tuple[str, int], tuple[str, int]]
    sent = 0
    received = 0

    def close(self) -> None:
        if self.fileno() >= 0:
            self._book.gone(self)
        super().close()

    def send(self, data: Any, flags: int = 0) -> int:
        n = super().send(data, flags)
        if n:
            self.sent += n
            self._book.sent(self)
        return n

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        n = super().sendmsg(buffers, *args)
        if n:
            self.sent += n
            self._book.sent(self)
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if data:
            self.received += len(data)
            self._book.read(self)
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        n = super().recv_into(buffer, nbytes, flags)
        if n:
            self.received += n
            self._book.read(self)
        return n


def _reverse(key: tuple) -> tuple:
    return key[1], key[0]


class _Book:
    """The partition's open TCP sockets by (local, peer) address, and the senders whose bytes
    a socket of this process has yet to read (`owed`: sender key → bytes it sent), kept as
    they change so that the idle check is one look."""

    def __init__(self) -> None:
        self.socks: dict[tuple, _Counted] = {}
        self.owed: dict[tuple, int] = {}
        self.closed: set[tuple] = set()  # sockets closed since: nothing sent to them is owed
        self.listening: set[tuple[str, int]] = set()  # the partition's servers' addresses

    def wrap(self, sock: socket.socket) -> socket.socket:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return sock
        try:
            key = ((str(sock.getsockname()[0]), int(sock.getsockname()[1])),
                   (str(sock.getpeername()[0]), int(sock.getpeername()[1])))
        except OSError:
            return sock
        new = _Counted(sock.family, sock.type, sock.proto, fileno=sock.detach())
        new.setblocking(False)
        new._book, new._key = self, key
        self.socks[key] = new
        self.closed.discard(key)
        return new

    def sent(self, sock: _Counted) -> None:
        """Bytes to a reader in this process (a peer socket, or one of our servers that has
        not accepted the connection yet) are owed until it reads them."""
        key = sock._key
        peer = self.socks.get(_reverse(key))
        if peer is not None:
            if peer.received < sock.sent:
                self.owed[key] = sock.sent
        elif key[1] in self.listening and _reverse(key) not in self.closed:
            self.owed[key] = sock.sent

    def read(self, sock: _Counted) -> None:
        sender = _reverse(sock._key)
        owed = self.owed.get(sender)
        if owed is not None and owed <= sock.received:
            del self.owed[sender]

    def gone(self, sock: _Counted) -> None:
        """What was sent to a closed socket and not read, nobody will read; what it sent
        itself is still read by its peer."""
        key = sock._key
        if self.socks.get(key) is sock:
            del self.socks[key]
            if _reverse(key) in self.socks:
                self.closed.add(key)  # its peer may still send to it
            else:
                self.closed.discard(_reverse(key))  # both ends gone: neither is asked about
        self.owed.pop(_reverse(key), None)

    def in_flight(self) -> bool:
        """Whether a byte one socket of this process sent is not yet read by its reader."""
        return bool(self.owed)


class _Selector(WriterSelector):
    """Epoll, but in virtual time a wait with nothing left to do moves the clock instead."""

    def __init__(self, clock: PartitionClock, book: _Book) -> None:
        super().__init__()
        self.clock, self.book = clock, book
        self.loop: PartitionLoop | None = None

    def select(self, timeout: float | None = None) -> list:
        if not self.clock.virtual or (timeout is not None and timeout <= 0):
            return super().select(timeout)
        loop = self.loop
        assert loop is not None
        waited = time.monotonic()
        while True:
            events = super().select(0)
            if events:
                return events
            if not (loop.threads or self._writers or self.book.in_flight()):
                due = loop.next_deadline()
                if math.isfinite(due):
                    self.clock.advance(due)
                    return []
                # no timer, nothing out: only the outside (a signal, a subprocess) can wake it
                return super().select(1.0)
            events = super().select(0.001 if self.book.in_flight() else 1.0)
            if events:
                return events
            if time.monotonic() - waited > STALL_S and loop.on_stall is not None:
                loop.on_stall(f"the partition waited {STALL_S:g} s of wall time for "
                              f"{loop.threads} thread job(s), {len(self._writers)} socket(s) "
                              f"with bytes to write, or bytes in flight")
                waited = time.monotonic()


class PartitionLoop(CountingLoop):
    """asyncio's selector loop on a partition's own clock (module docstring)."""

    def __init__(self, clock: PartitionClock) -> None:
        self.clock = clock
        self.book = _Book()
        self.threads = 0
        self.on_stall: Callable[[str], None] | None = None
        # per node: its tasks, its connections' transports, its servers (weakly: what ends
        # is forgotten)
        self._owned: dict[str, tuple[weakref.WeakSet, weakref.WeakSet, list]] = {}
        selector = _Selector(clock, self.book)
        super().__init__(selector)
        selector.loop = self
        self.set_task_factory(_owned_task)

    def _of(self, node: str) -> tuple[weakref.WeakSet, weakref.WeakSet, list]:
        owned = self._owned.get(node)
        if owned is None:
            owned = self._owned[node] = (weakref.WeakSet(), weakref.WeakSet(), [])
        return owned

    def crash(self, node: str) -> int:
        """End `node` as a killed process ends: its servers stop listening, its connections
        close under their peers, its tasks are cancelled. Returns the tasks cancelled."""
        tasks, transports, servers = self._owned.pop(node, ((), (), ()))
        for server in servers:
            for sock in server.sockets:
                name = sock.getsockname()
                self.book.listening.discard((str(name[0]), int(name[1])))
            server.close()
        for transport in list(transports):
            transport.abort()
        alive = [t for t in list(tasks) if not t.done()]
        for task in alive:
            task.cancel(f"node {node} crashed")
        return len(alive)

    def time(self) -> float:
        return self.clock.now()

    def _count_jobs(self, change: int) -> None:
        self.threads += change

    def _make_socket_transport(self, sock: socket.socket, protocol: Any, waiter: Any = None,
                               *, extra: Any = None, server: Any = None) -> Any:
        transport = super()._make_socket_transport(self.book.wrap(sock), protocol, waiter,
                                                   extra=extra, server=server)
        node = NODE.get()
        if node is not None:
            self._of(node)[1].add(transport)
        return transport

    async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.Server:
        server = await super().create_server(*args, **kwargs)
        for sock in server.sockets:
            name = sock.getsockname()
            self.book.listening.add((str(name[0]), int(name[1])))
        node = NODE.get()
        if node is not None:
            self._of(node)[2].append(server)
        return server


def _owned_task(loop: PartitionLoop, coro: Any, context: contextvars.Context | None = None
                ) -> asyncio.Task:
    """asyncio's task, remembered as its node's (the node of the context it runs in)."""
    task = asyncio.Task(coro, loop=loop, context=context)
    node = context.get(NODE) if context is not None else NODE.get()
    if node is not None:
        loop._of(node)[0].add(task)
    return task
