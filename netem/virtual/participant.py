"""One process's side of virtual time: an event loop whose clock is the shared clock word and
which tells the authority when it has nothing left to do.

`VirtualLoop` is asyncio's selector loop with three changes:
- `time()` reads the shared clock (`netem.virtual.shared`), so `asyncio.sleep`, `call_at`,
  timeouts and aiohttp's own timers all run on the mesh's clock;
- its selector (`ClockSelector`) reports *idle* to the authority, with the loop's earliest
  timer and this process's byte counters, whenever the loop would block in virtual time, and
  *busy* before it hands the loop any event after that which no counted byte announces (a
  byte another process sent and this one has not counted keeps the clock still by itself),
  so the authority never acts on a stale "idle" of a process that is already working;
- every TCP socket it creates or accepts counts the bytes it sends and receives and says when
  it closed, named by its address pair (both ends of a loopback or veth connection name it
  alike) and the monotonic time it was made (an address pair carries one connection after
  another), so the authority knows when a message is still in flight;
- work handed to threads (`run_in_executor`) keeps the process busy until it is back, and so
  do bytes it has yet to write (a socket whose send buffer was full, a connect in progress).

Until `Agent.register` the loop runs on the shared clock without reporting (a node still
starting up); in real-time mode it is an ordinary loop on that clock.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import selectors
import socket
import struct
import termios
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from .loops import CountingLoop, WriterSelector
from .shared import SharedClock

__all__ = ["CLOCK_DIR_ENV", "CLOCK_ENV", "Agent", "VirtualLoop", "agent_from_env", "own_addresses",
           "wait_for_clock"]

CLOCK_ENV = "MOEMESH_CLOCK"  # the run's clock folder: `time` (the clock word), `sock`
# A folder where a run's clock will appear (a volume shared with the controller's container):
# a node started before its controller waits there until the authority listens.
CLOCK_DIR_ENV = "MOEMESH_CLOCK_DIR"
WAKE, MODE = b"w", b"m"  # authority → process
_CHANNEL = object()  # the selector key data of the authority's channel


class Agent:
    """This process's link to the authority: the clock, the channel, the counters."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.clock = SharedClock(self.folder / "time")
        self.chan: socket.socket | None = None
        self.name = ""
        # socket (local host, port, peer host, port, monotonic ns made) → [sent, received,
        # closed]; a closed socket is forgotten once reported
        self.counts: dict[tuple, list[int]] = {}
        self._dirty: set[tuple] = set()
        self.threads = 0  # executor jobs not yet back
        self.idle = False  # an idle report is standing
        self.on_lost: Callable[[], None] | None = None  # the authority went away

    # -- life ---------------------------------------------------------------------------
    def register(self, name: str, listens: Sequence[tuple[str, int]] = ()) -> None:
        """Join the mesh's clock: from now on the authority waits for this process.
        `listens`: the addresses its servers listen on (bytes sent there that it never read
        are forgotten if it dies)."""
        chan = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        chan.connect(str(self.folder / "sock"))
        self.name = name
        self.chan = chan
        own = [(a, int(p)) for h, p in listens
               for a in (own_addresses() if h in ("", "0.0.0.0", "::") else [h])]
        self._send(["hello", name, os.getpid(), [[h, p] for h, p in own]])
        self.idle = False
        self._on_register(chan)

    def _on_register(self, chan: socket.socket) -> None:  # set by the loop's selector
        pass

    def close(self) -> None:
        """Leave on purpose (a clean exit is not a death)."""
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self._send(["bye"])
            self.chan.close()
            self.chan = None

    # -- reports --------------------------------------------------------------------------
    def _send(self, msg: list[Any]) -> None:
        assert self.chan is not None
        self.chan.send(msgpack.packb(msg))

    def report_idle(self, deadline: float) -> None:
        changed = []
        for key in self._dirty:
            c = self.counts[key]
            changed.append([*key, *c])
            if c[2]:
                del self.counts[key]
        self._dirty.clear()
        self._send(["idle", deadline if math.isfinite(deadline) else None, changed])
        self.idle = True

    def report_busy(self) -> None:
        if self.idle:
            self.idle = False
            self._send(["busy"])

    def drain(self) -> bool:
        """Read what the authority sent; True when the channel closed (the run is gone)."""
        assert self.chan is not None
        while True:
            try:
                msg = self.chan.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            except OSError:
                msg = b""
            if not msg:
                return True
            if msg == WAKE:
                self.idle = False  # the authority counts a woken process as busy

    # -- byte counters ------------------------------------------------------------------
    def count(self, key: tuple, sent: int, received: int) -> None:
        c = self.counts.get(key)
        if c is None:
            c = self.counts[key] = [0, 0, 0]
        c[0] += sent
        c[1] += received
        self._dirty.add(key)

    def closed(self, key: tuple) -> None:
        """The socket closed: whatever was sent to it and not read, nobody will read."""
        self.count(key, 0, 0)
        self.counts[key][2] = 1


def _endpoint(addr: Any) -> tuple[str, int]:
    return str(addr[0]), int(addr[1])


class _CountingSocket(socket.socket):
    """A TCP socket that adds what it sends and receives to its process's counters, and says
    when it closes."""

    _agent: Agent
    _key: tuple

    def close(self) -> None:
        if self.fileno() >= 0:
            self._agent.closed(self._key)
        super().close()

    def send(self, data: Any, flags: int = 0) -> int:
        n = super().send(data, flags)
        self._agent.count(self._key, n, 0)
        return n

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        n = super().sendmsg(buffers, *args)
        self._agent.count(self._key, n, 0)
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if data:
            self._agent.count(self._key, 0, len(data))
        return data

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        n = super().recv_into(buffer, nbytes, flags)
        if n:
            self._agent.count(self._key, 0, n)
        return n


def _counting(sock: socket.socket, agent: Agent) -> socket.socket:
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return sock
    try:
        key = (*_endpoint(sock.getsockname()), *_endpoint(sock.getpeername()))
    except OSError:  # not connected (any more): nothing will cross it
        return sock
    new = _CountingSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    new.setblocking(False)
    new._agent, new._key = agent, (*key, time.monotonic_ns())
    agent.count(new._key, 0, 0)  # known from the start: its place in the pair's order
    return new


def _bytes_waiting(events: list) -> bool:
    """Whether every event is counted bytes waiting to be read. Then no *busy* is needed: the
    sender counted them and this process has not, so the connection stays unbalanced (and
    the clock still) until this process reports again. An accept, an end of stream, a
    thread's or a signal's wake-up, a socket turned writable carry no counted byte: those
    must say *busy* before the loop touches them."""
    for key, mask in events:
        sock = key.fileobj
        if mask != selectors.EVENT_READ or not isinstance(sock, _CountingSocket):
            return False
        try:
            waiting = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD,
                                                     b"\0\0\0\0"))[0]
        except OSError:
            return False
        if waiting <= 0:
            return False
    return True


class ClockSelector(WriterSelector):
    """The loop's selector; in virtual time a wait with nothing runnable becomes an idle
    report and a wait for the authority (see the module docstring)."""

    def __init__(self, agent: Agent) -> None:
        super().__init__()
        self._agent = agent
        self.loop: VirtualLoop | None = None
        agent._on_register = self._attach  # type: ignore[method-assign]

    def _attach(self, chan: socket.socket) -> None:
        super().register(chan, selectors.EVENT_READ, _CHANNEL)

    def _poll(self, timeout: float | None) -> tuple[list, bool]:
        """(the loop's events, whether the authority wrote)."""
        events, chan = [], False
        for key, mask in super().select(timeout):
            if key.data is _CHANNEL:
                chan = True
            else:
                events.append((key, mask))
        if chan and self._agent.drain():  # the authority is gone: the run ended under us
            lost = self._agent.chan
            assert lost is not None
            super().unregister(lost)
            lost.close()
            self._agent.chan = None
            if self._agent.on_lost is not None:
                self._agent.on_lost()
        return events, chan

    def select(self, timeout: float | None = None) -> list:
        a = self._agent
        if a.chan is None or a.threads or self._writers or (
                timeout is not None and timeout <= 0) or not a.clock.virtual:
            return self._poll(timeout)[0]
        events, _ = self._poll(0)
        if events:
            return events
        assert self.loop is not None
        a.report_idle(self.loop.next_deadline())
        while True:
            events, chan = self._poll(None)
            if events:
                if not _bytes_waiting(events):
                    a.report_busy()
                return events
            if chan or a.chan is None:
                return []  # the clock moved (timers are due) or the mode changed


class VirtualLoop(CountingLoop):
    """asyncio's selector loop on the mesh's shared clock (see the module docstring)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        selector = ClockSelector(agent)
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.agent.clock.now()

    def _count_jobs(self, change: int) -> None:
        self.agent.threads += change

    def _make_socket_transport(self, sock: socket.socket, protocol: Any, waiter: Any = None,
                               *, extra: Any = None, server: Any = None) -> Any:
        return super()._make_socket_transport(_counting(sock, self.agent), protocol, waiter,
                                              extra=extra, server=server)


def own_addresses() -> list[str]:
    """This network namespace's IPv4 addresses. A node listening on 0.0.0.0 serves these:
    in containers every node listens on the same port, so the port alone names no node."""
    found = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                answer = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
                found.append(socket.inet_ntoa(answer[20:24]))
    finally:
        probe.close()
    return found or ["0.0.0.0"]


def wait_for_clock(folder: str | Path, *, poll_s: float = 0.2) -> Path:
    """Wait until a run's authority listens in `folder` (a node of a compose mesh starts
    before its controller), then return the folder. The authority writes the clock word
    before it listens, so a clock seen after a successful connect is the live run's."""
    folder = Path(folder)
    said = False
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(folder / "sock"))
            return folder
        except OSError:
            if not said:
                print(f"moemesh: waiting for the run's clock in {folder} (the controller "
                      f"starts it)", flush=True)
                said = True
            time.sleep(poll_s)
        finally:
            probe.close()


def agent_from_env() -> Agent | None:
    """The run's clock when this process was started inside one (MOEMESH_CLOCK), or the
    one that will appear in MOEMESH_CLOCK_DIR (waited for)."""
    folder = os.environ.get(CLOCK_ENV)
    if folder:
        return Agent(folder)
    shared = os.environ.get(CLOCK_DIR_ENV)
    return Agent(wait_for_clock(shared)) if shared else None
