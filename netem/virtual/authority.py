"""The one owner of a run's virtual time: it advances the clock when the whole mesh is idle.

Every process of the mesh (each node, the run's controller) runs a `VirtualLoop` and talks to
the authority over a Unix SOCK_SEQPACKET socket (`folder/sock`); the clock itself is the word
in `folder/time` (`netem.virtual.shared`), which only the authority writes. A process says
*idle* (its earliest timer and the byte counters of the connections that changed) when its
loop has nothing runnable and no thread work out, and *busy* before it touches anything after
that. The authority advances the clock to the earliest timer of all, and wakes the processes
whose timers are due, only when

- every process it knows is idle, and every node it was told to expect has joined;
- every TCP connection between them is balanced: what one end sent, the other end received
  (termination detection by message counting: a byte in flight means someone will wake),
  or the receiving end has closed its socket (what it never read, nobody will).

An address pair may carry several connections one after another (the kernel reuses a closed
pair's ports, from another process too), so the counters are per socket: each end reports its
sockets by the monotonic time they were made, and the k-th socket at one end of a pair is the
k-th connection's other end of the k-th at the other (`_Conn`).

Events due at one instant run in each process's timer order (asyncio's heap, fed in the same
order each run), so a run is repeatable. The clock starts in real time (it runs at the
wall's pace, for starting processes and anything else outside the emulation) and a run
switches it to virtual time for the measured part (`go_virtual`, `go_realtime`).

Nothing freezes time: a process whose channel closes without saying goodbye, and which the
runtime did not announce (`expect_exit`), is recorded as dead and its connections are
forgotten, so the others carry on with it down; a mesh that stays busy or unbalanced for
`stall_s` wall seconds is reported (`on_stall`) with the processes and connections it waits for.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from .participant import CLOCK_ENV, MODE, WAKE
from .shared import REALTIME, VIRTUAL, SharedClock

__all__ = ["Authority", "current", "use", "virtual_origin"]

STALL_S = 60.0  # wall seconds without progress before the mesh is reported stuck
_Endpoint = tuple[str, int]


def virtual_origin(now: float) -> float:
    """Where virtual time starts: the next whole second of a clock that began at 2**21 s.
    Every virtual time of a run then lies in [2**21, 2**22) s, one binade, where adding
    a delay rounds the same way whatever second the run switched at: runs repeat to the bit."""
    return float(math.ceil(max(now, 2.0 ** 21)))


@dataclass(eq=False)
class _Part:
    sock: socket.socket
    name: str = ""
    pid: int = 0
    idle: bool = False
    deadline: float = math.inf
    since: float = field(default_factory=time.monotonic)  # wall time of the last change
    leaving: bool = False
    keys: set[tuple] = field(default_factory=set)
    listens: list[tuple[str, int]] = field(default_factory=list)  # its servers' addresses


def _waits(pid: int) -> str:
    """Where a process's threads wait in the kernel (/proc wchan), for a stall's message."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return "gone"
    seen: dict[str, int] = {}
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as fh:
                where = fh.read().strip() or "running"
        except OSError:
            continue
        seen[where] = seen.get(where, 0) + 1
    return " ".join(f"{w}x{n}" if n > 1 else w for w, n in sorted(seen.items()))


@dataclass(eq=False)
class _Socket:
    """One socket at one end of an address pair, as its process reported it."""

    owner: _Part
    opened: int  # time.monotonic_ns() when it was made: the order of the pair's connections
    sent: int = 0
    received: int = 0
    closed: bool = False


class _Conn:
    """The connections of one address pair. A pair is reused only once both ends of the last
    connection on it have closed, so each end's sockets, in the order they were made, pair up
    k-th with k-th; a connection whose two sockets have closed is forgotten."""

    def __init__(self) -> None:
        self.ends: tuple[dict, dict] = ({}, {})  # (pid, opened) → _Socket

    def update(self, side: int, part: _Part, opened: int, sent: int, received: int,
               closed: bool) -> None:
        sock = self.ends[side].get((part.pid, opened))
        if sock is None:
            sock = self.ends[side][(part.pid, opened)] = _Socket(part, opened)
        sock.sent, sock.received, sock.closed = sent, received, closed
        self._forget_closed()

    def _ordered(self, side: int) -> list[_Socket]:
        return sorted(self.ends[side].values(), key=lambda k: (k.opened, k.owner.pid))

    def pairs(self) -> list[tuple[_Socket | None, _Socket | None]]:
        return list(itertools.zip_longest(self._ordered(0), self._ordered(1)))

    def _forget_closed(self) -> None:
        for a, b in self.pairs():
            if a is None or b is None or not (a.closed and b.closed):
                return
            del self.ends[0][(a.owner.pid, a.opened)], self.ends[1][(b.owner.pid, b.opened)]

    @property
    def empty(self) -> bool:
        return not (self.ends[0] or self.ends[1])

    def unread(self) -> tuple[int, int]:
        """Bytes in flight towards end 1 and towards end 0 that an open socket will read."""
        to1 = to0 = 0
        for a, b in self.pairs():
            if a is None or b is None:  # the other end's socket is not reported yet
                one = a or b
                assert one is not None
                if not one.closed and one.sent:
                    to1, to0 = (to1 + one.sent, to0) if a is not None else (to1, to0 + one.sent)
                continue
            if not b.closed:
                to1 += a.sent - b.received
            if not a.closed:
                to0 += b.sent - a.received
        return to1, to0

    def balanced(self) -> bool:
        return self.unread() == (0, 0)


_CURRENT: Authority | None = None


def current() -> Authority | None:
    """The authority of the run in this process, if any (runtimes announce nodes to it)."""
    return _CURRENT


def use(clock: Any) -> None:
    """Make `clock` (an Authority or a partition's clock, the same interface) the process's
    current one, or none."""
    global _CURRENT
    _CURRENT = clock


class Authority:
    """See the module docstring. Thread-safe: a thread of its own serves the processes; the
    public methods may be called from any thread."""

    def __init__(self, *, stall_s: float = STALL_S, folder: str | Path | None = None) -> None:
        # `folder`: a given place (a volume the nodes' containers share, where they wait for
        # the clock, participant.wait_for_clock); its last run's files are replaced. Default:
        # a fresh temporary folder.
        self._own_folder = folder is None
        if folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="moemesh-clock-"))
            # moemesh clean finds it after a killed run by this marker and removes what it
            # lists (netem.markers, the marks on every folder moemesh makes)
            from netem.markers import mark

            mark(self.folder, "clock", made=("time", "sock"))
        else:
            self.folder = Path(folder)
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in ("sock", "time"):
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / stale).unlink()
        self.clock = SharedClock(self.folder / "time", create=True)
        self.clock.set(REALTIME, 2.0 ** 21)  # real time, counted from 2**21 s (virtual_origin)
        self.stall_s = stall_s
        self.on_stall: Callable[[str], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self.deaths: list[dict[str, Any]] = []
        self.advances = 0  # clock moves in virtual time
        self.wakes = 0  # processes woken by those moves (their timers were due)
        self.reports = 0  # idle and busy reports read in virtual time
        self.virtual_s = 0.0  # virtual seconds passed in virtual mode
        self.wall_s = 0.0  # wall seconds spent in virtual mode
        self._mode = REALTIME
        self._mode_since = (0.0, 0.0)
        self._lock = threading.RLock()
        self._parts: dict[socket.socket, _Part] = {}
        self._expected: dict[str, float] = {}  # node → wall time it was announced
        self._exits: set[str] = set()  # nodes the runtime is ending on purpose
        self._conns: dict[tuple[_Endpoint, _Endpoint], _Conn] = {}
        self._dead_keys: set[tuple] = set()
        self._unbalanced = 0
        self._holds: list[str] = []  # why the controller holds the clock still (`held`)
        self._progress = time.monotonic()
        self._stall_said = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(str(self.folder / "sock"))
        self._listener.listen(64)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="moemesh-clock", daemon=True)
        self._thread.start()

    # -- for the run ----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """What a process of the mesh needs in its environment to join this clock."""
        return {CLOCK_ENV: str(self.folder)}

    @property
    def virtual(self) -> bool:
        return self._mode == VIRTUAL

    def expect(self, name: str) -> None:
        """A node is being started: the clock waits for it to join."""
        with self._lock:
            self._exits.discard(name)
            if any(p.name == name for p in self._parts.values()):
                return  # joined already (a container that started before its controller)
            self._expected[name] = time.monotonic()
        self._poke()

    def forget(self, name: str) -> None:
        """A node announced with `expect` will not come (its start failed)."""
        with self._lock:
            self._expected.pop(name, None)
        self._poke()

    def expect_exit(self, name: str) -> None:
        """The runtime is ending this node on purpose (node-down, stop): not a death."""
        with self._lock:
            self._exits.add(name)
            self._expected.pop(name, None)
        self._poke()

    def go_virtual(self) -> float:
        """Switch to virtual time; returns the virtual time it starts at."""
        with self._lock:
            if self._mode == VIRTUAL:
                return self.clock.now()
            start = virtual_origin(self.clock.now())
            self._switch(VIRTUAL, start)
            return start

    def go_realtime(self) -> None:
        """Back to the wall's pace, from the virtual time reached."""
        with self._lock:
            if self._mode == REALTIME:
                return
            self._switch(REALTIME, self.clock.now())

    def stats(self) -> dict[str, Any]:
        """What run.json records of the clock."""
        with self._lock:
            virtual_s, wall_s = self.virtual_s, self.wall_s
            if self._mode == VIRTUAL:
                virtual_s += self.clock.now() - self._mode_since[0]
                wall_s += time.monotonic() - self._mode_since[1]
            return {"advances": self.advances, "wakes": self.wakes, "reports": self.reports,
                    "virtual_s": round(virtual_s, 6),
                    "wall_s": round(wall_s, 3),
                    "virtual_speedup": round(virtual_s / wall_s, 4) if wall_s > 0 else None,
                    "deaths": list(self.deaths)}

    def close(self) -> None:
        global _CURRENT
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._poke()
        self._thread.join(timeout=5.0)
        for part in list(self._parts.values()):
            part.sock.close()
        self._listener.close()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.clock.close()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        else:  # sock first: a waiting node must never connect to a clock without its word
            for name in ("sock", "time"):
                with contextlib.suppress(OSError):
                    (self.folder / name).unlink()
        if _CURRENT is self:
            _CURRENT = None

    def install(self) -> Authority:
        """Make this the process's current authority (`current()`)."""
        global _CURRENT
        _CURRENT = self
        return self

    def mark_busy(self, sock_name: str) -> None:
        """The named process was just handed work from outside its sockets (a callback
        posted into its loop): it counts as busy until it reports again."""
        with self._lock:
            for part in self._parts.values():
                if part.name == sock_name:
                    part.idle = False

    @contextlib.contextmanager
    def held(self, why: str) -> Iterator[None]:
        """The clock stays where it is for the body. For work of the controller outside the
        mesh that must land at this instant (a container engine's kill or start): its answer
        comes over a socket the clock does not count, so the idle controller would otherwise
        let the clock run on meanwhile, by however much the engine took."""
        with self._lock:
            self._holds.append(why)
        try:
            yield
        finally:
            with self._lock:
                self._holds.remove(why)
            self._poke()

    # -- the thread -----------------------------------------------------------------------
    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _switch(self, mode: int, value: float) -> None:
        now_wall = time.monotonic()
        if self._mode == VIRTUAL:
            self.virtual_s += value - self._mode_since[0]
            self.wall_s += now_wall - self._mode_since[1]
        self._mode = mode
        self._mode_since = (value, now_wall)
        self.clock.set(mode, value)
        self._progress = now_wall
        for part in self._parts.values():
            part.idle = False
            self._tell(part, MODE)
        self._poke()

    def _tell(self, part: _Part, what: bytes) -> None:
        # never block the clock on one process: a full queue means it has messages to read
        # and will wake for them anyway (the time itself is in the clock word)
        with contextlib.suppress(OSError):
            part.sock.send(what, socket.MSG_DONTWAIT)

    def _serve(self) -> None:
        while True:
            ready = self._sel.select(timeout=1.0)
            with self._lock:
                if self._closed:
                    return
                for key, _ in ready:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            while os.read(self._wake_r, 4096):
                                pass
                    else:
                        self._read(key.data)
                if self._mode == VIRTUAL:
                    self._advance()
                    self._watch()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            sock, _ = self._listener.accept()
            part = _Part(sock)
            self._parts[sock] = part
            self._sel.register(sock, selectors.EVENT_READ, part)

    def _read(self, part: _Part) -> None:
        while True:
            try:
                raw = part.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                raw = b""
            if not raw:
                self._gone(part)
                return
            self._progress = time.monotonic()
            msg = msgpack.unpackb(raw)
            kind = msg[0]
            if kind in ("idle", "busy") and self._mode == VIRTUAL:
                self.reports += 1
            if kind == "idle":
                part.idle = True
                part.deadline = math.inf if msg[1] is None else float(msg[1])
                for lip, lport, pip, pport, opened, sent, recv, closed in msg[2]:
                    self._count(part, (lip, lport), (pip, pport), opened, sent, recv,
                                bool(closed))
            elif kind == "busy":
                part.idle = False
            elif kind == "hello":
                part.name, part.pid = str(msg[1]), int(msg[2])
                part.listens = [(str(h), int(p)) for h, p in (msg[3] if len(msg) > 3 else ())]
                self._expected.pop(part.name, None)
                self._exits.discard(part.name)
            elif kind == "bye":
                part.leaving = True
            part.since = self._progress

    def _count(self, part: _Part, local: _Endpoint, peer: _Endpoint, opened: int, sent: int,
               recv: int, closed: bool) -> None:
        side = 0 if local < peer else 1
        key = (local, peer) if side == 0 else (peer, local)
        if key in self._dead_keys:
            return
        conn = self._conns.get(key)
        if conn is None:
            conn = self._conns[key] = _Conn()
        was = conn.balanced()
        conn.update(side, part, opened, sent, recv, closed)
        now = conn.balanced()
        self._unbalanced += (not now) - (not was)
        if conn.empty:
            del self._conns[key]
        part.keys.add(key)

    def _gone(self, part: _Part) -> None:
        """A process's channel closed: it left (bye, or ended on purpose) or it died."""
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(part.sock)
        part.sock.close()
        self._parts.pop(part.sock, None)
        served = {p for _, p in part.listens}
        lost = set(part.keys)
        for key in self._conns:  # bytes sent to its servers that it never counted
            for side in (0, 1):
                if key[side][1] in served and any(
                        h in ("0.0.0.0", "::", "", key[side][0]) for h, _ in part.listens):
                    lost.add(key)
        for key in lost:
            conn = self._conns.pop(key, None)
            if conn is not None and not conn.balanced():
                self._unbalanced -= 1
            self._dead_keys.add(key)
        on_purpose = part.leaving or part.name in self._exits
        self._exits.discard(part.name)
        if part.name and not on_purpose:
            death = {"node": part.name, "pid": part.pid,
                     "virtual_s": round(self.clock.now(), 6),
                     "wall": time.strftime("%H:%M:%S")}
            self.deaths.append(death)
            if self.on_death is not None:
                self.on_death(part.name)
        self._progress = time.monotonic()

    def _advance(self) -> None:
        if self._expected or self._unbalanced or self._holds or not self._parts:
            return
        deadline = math.inf
        for part in self._parts.values():
            if not part.idle:
                return
            deadline = min(deadline, part.deadline)
        if not math.isfinite(deadline):
            return  # nothing will ever happen: the watchdog says so
        value = max(deadline, self.clock.now())
        self.clock.set(VIRTUAL, value)
        self.advances += 1
        self._progress = time.monotonic()
        self._stall_said = False
        for part in self._parts.values():
            if part.deadline <= value:
                part.idle = False
                part.deadline = math.inf
                self.wakes += 1
                self._tell(part, WAKE)

    def _watch(self) -> None:
        if self._stall_said or time.monotonic() - self._progress < self.stall_s:
            return
        self._stall_said = True
        message = self.describe_stall()
        if self.on_stall is not None:
            self.on_stall(message)

    def describe_stall(self) -> str:
        """What the clock is waiting for, in words."""
        now = time.monotonic()
        why = [f"node {n} was started {now - t:.0f} s ago and never joined the clock"
               for n, t in self._expected.items()]
        why += [f"the controller holds it: {w}" for w in self._holds]
        why += [f"{p.name or f'pid {p.pid}'} has been busy for {now - p.since:.0f} s"
                for p in self._parts.values() if not p.idle]
        if self._unbalanced:
            stuck = []
            for (a, b), conn in self._conns.items():
                to1, to0 = conn.unread()
                if (to1, to0) != (0, 0):
                    owners = [",".join(sorted({k.owner.name or str(k.owner.pid)
                                               for k in end.values()})) or "?"
                              for end in conn.ends]
                    stuck.append(f"{a[0]}:{a[1]} ({owners[0]}) <-> {b[0]}:{b[1]} ({owners[1]}): "
                                 f"{to1:+d} / {to0:+d} bytes unread")
            why.append(f"{self._unbalanced} connection(s) with bytes in flight that nobody "
                       f"reads: " + "; ".join(stuck[:5]))
        if not why:
            why.append("every process is idle with no timer due: nothing can happen any more")
        why.append("processes: " + ", ".join(
            f"{p.name or p.pid} {'idle' if p.idle else 'busy'} {now - p.since:.0f} s"
            + (f" (timer at +{p.deadline - self.clock.now():.6f} s)"
               if p.idle and math.isfinite(p.deadline) else "")
            + f" [{_waits(p.pid)}]"
            for p in self._parts.values()))
        return (f"virtual time stalled: no progress for {self.stall_s:g} s of wall time; "
                + "; ".join(why))
