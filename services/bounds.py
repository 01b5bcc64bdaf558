"""Bounds on every connection to a node: header, body and idle timeouts, and a connection cap.

Why: a client that opens a connection and then stalls (a slow header, a slow body, an idle
keep-alive) held a node's socket and memory for ever (1,000 of them stayed past 203 s), and a
flood of connections could take every file descriptor. These bounds protect the host, so they
run on the host's wall clock (`time.monotonic`), never on the emulated clock: on a shared
virtual clock (netem.virtual) the emulated time may stand still or jump while bytes wait.
They cannot fire on a legitimate request in virtual time, because a request's bytes are all
on the host before any emulated delay starts (the app shaper sends a request at once and
the receiver waits for its emulated arrival after reading it: services.routes.forward), and
while a handler runs (queueing, compute, emulated waits) its connection has no deadline.

A connection is in one of four states, each with its own deadline:

    idle  (accepted, or its last answer handed over)  -> closed after `idle_s` without a byte
    head  (a request's first byte came)                -> closed unless its header is whole
                                                          within `header_s`
    body  (the header is whole, the handler started)   -> closed unless the body is whole
                                                          within `body_s` + length/`body_rate`
    busy  (the body is whole: the handler works)       -> no deadline

A watchdog thread checks the deadlines every `tick_s` and wakes the node's loop only when one
has passed (the loop then closes those connections): a loop on a virtual clock sleeps until
the mesh's clock moves, and a loop timer would run on that clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

__all__ = ["ServerLimits", "body_done", "body_started", "guarded_runner", "request_done"]

log = logging.getLogger(__name__)

IDLE, HEAD, BODY, BUSY = "idle", "head", "body", "busy"
_WHY = {IDLE: "idle", HEAD: "no whole header", BODY: "no whole body"}


@dataclass(frozen=True)
class ServerLimits:
    """The node server's connection bounds (seconds of wall clock, bytes per second,
    connections); docs/contracts.md says why each value.

    `idle_s` is 75 s, 2.5 times the client's keep-alive (services.client.ClientSettings
    .keepalive_s, 30 s), so the server never closes a connection a client may still pick
    from its pool. `header_s` 10 s: a header is a few hundred bytes, sent in one write.
    `body_s` 30 s plus one second per `body_rate` bytes: the largest forward body (256 rows
    of width 4,096 in f32, 4 MiB) may take 64 s more at 64 kB/s, slower than any link a
    shipped scenario emulates in the kernel (tc) at its time dilation. `max_connections`
    4,096: in a 100-node mesh a node may hold a pool of up to 32 data-plane connections
    (ClientSettings.per_node) from each of 99 peers, 3,168, plus the controller's 32 of each
    plane and room for probes; more is refused with a 503 and the connection closed."""

    header_s: float = 10.0
    body_s: float = 30.0
    body_rate: float = 64_000.0
    idle_s: float = 75.0
    max_connections: int = 4096
    tick_s: float = 0.5  # how often the watchdog looks (the bounds are late by at most this)

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s", "body_rate", "idle_s", "tick_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"limits.{name} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.max_connections, int) and self.max_connections >= 1):
            raise ValueError(f"limits.max_connections must be an int >= 1, "
                             f"got {self.max_connections!r}")

    def body_deadline_s(self, length: int | None, limit: int) -> float:
        """Seconds a body of `length` bytes (None: chunked, up to `limit`) may take."""
        return self.body_s + (limit if length is None else length) / self.body_rate


class _Guarded(RequestHandler):
    """aiohttp's request handler with a state and a wall-clock deadline (module docstring)."""

    guard: _Guard  # set on the class made per server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.mm_state = IDLE
        self.mm_deadline = time.monotonic() + self.guard.limits.idle_s
        self.mm_request: web.BaseRequest | None = None
        self.guard.admit(self, transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.conns.discard(self)
        self.mm_request = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if getattr(self, "mm_state", None) == IDLE and data:
            self.mm_state = HEAD
            self.mm_deadline = time.monotonic() + self.guard.limits.header_s
        super().data_received(data)


class _Guard:
    """The connections of one server, their cap and the watchdog thread."""

    def __init__(self, limits: ServerLimits, body_limit: int) -> None:
        self.limits = limits
        self.body_limit = body_limit
        self.conns: set[_Guarded] = set()
        self.refused = 0
        self.closed = {IDLE: 0, HEAD: 0, BODY: 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._waking = False

    def admit(self, handler: _Guarded, transport: asyncio.BaseTransport) -> None:
        if len(self.conns) < self.limits.max_connections:
            self.conns.add(handler)
            return
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("refused a connection: this node holds %d, its limit "
                        "(%d refused so far)", len(self.conns), self.refused)
        body = json.dumps({"error": "overloaded", "detail": (
            f"this node holds {len(self.conns)} connections, its limit "
            f"(limits.max_connections); retry later")}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        transport.write(head + body)  # type: ignore[attr-defined]
        transport.close()

    # -- the watchdog ---------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._watch, name="conn-bounds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.limits.tick_s + 1)
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.limits.tick_s):
            if self._waking:
                continue
            now = time.monotonic()
            try:
                due = any(h.mm_deadline <= now for h in list(self.conns))
            except RuntimeError:  # the set changed while copied: look again next tick
                continue
            if due and self._loop is not None and not self._loop.is_closed():
                self._waking = True
                try:
                    self._loop.call_soon_threadsafe(self.sweep)
                except RuntimeError:  # the loop closed meanwhile
                    return

    def sweep(self) -> None:
        """On the loop: close every connection past its deadline (a body that is whole
        only waits for its handler: it becomes busy)."""
        self._waking = False
        now = time.monotonic()
        for h in list(self.conns):
            if h.mm_deadline > now or h.mm_state == BUSY:
                continue
            req = h.mm_request
            if h.mm_state == BODY and req is not None and req.content.is_eof():
                h.mm_state, h.mm_deadline = BUSY, math.inf
                continue
            self.closed[h.mm_state] += 1
            peer = h.transport.get_extra_info("peername") if h.transport else None
            log.debug("closing the connection from %s: %s within %g s", peer,
                      _WHY[h.mm_state], self._allowed(h))
            self.conns.discard(h)
            h.force_close()
            if h.transport is not None:
                h.transport.close()

    def _allowed(self, h: _Guarded) -> float:
        lim = self.limits
        if h.mm_state == BODY and h.mm_request is not None:
            return lim.body_deadline_s(h.mm_request.content_length, self.body_limit)
        return lim.header_s if h.mm_state == HEAD else lim.idle_s


def _handler_of(request: web.BaseRequest) -> _Guarded | None:
    h = request.protocol
    return h if isinstance(h, _Guarded) else None


def body_started(request: web.BaseRequest) -> None:
    """The header is whole and the handler starts: the body's deadline runs (none when the
    request has no body)."""
    h = _handler_of(request)
    if h is None:
        return
    if not request.body_exists or request.content.is_eof():
        h.mm_state, h.mm_deadline, h.mm_request = BUSY, math.inf, None
        return
    g = h.guard
    h.mm_state, h.mm_request = BODY, request
    h.mm_deadline = time.monotonic() + g.limits.body_deadline_s(request.content_length,
                                                                g.body_limit)


def body_done(request: web.BaseRequest) -> None:
    """The handler has the whole body: no deadline while it works."""
    h = _handler_of(request)
    if h is not None and h.mm_state == BODY:
        h.mm_state, h.mm_deadline, h.mm_request = BUSY, math.inf, None


def request_done(request: web.BaseRequest) -> None:
    """The handler returned: the connection is idle until the next request's first byte."""
    h = _handler_of(request)
    if h is not None and h.mm_state in (BODY, BUSY):
        h.mm_state, h.mm_request = IDLE, None
        h.mm_deadline = time.monotonic() + h.guard.limits.idle_s


class _GuardedServer(web.Server):
    def __init__(self, *args: Any, guard: _Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handler_class = type("GuardedHandler", (_Guarded,), {"guard": guard})

    def __call__(self) -> RequestHandler:
        return self._handler_class(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are bounded by `limits` (module docstring)."""

    def __init__(self, app: web.Application, limits: ServerLimits, body_limit: int,
                 **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.idle_s, **kwargs)
        self.guard = _Guard(limits, body_limit)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guarded = _GuardedServer(server.request_handler, request_factory=server.request_factory,
                                 handler_cancellation=server.handler_cancellation,
                                 loop=server._loop, guard=self.guard, **server._kwargs)
        return guarded

    async def setup(self) -> None:
        await super().setup()
        self.guard.start(asyncio.get_running_loop())

    async def cleanup(self) -> None:
        self.guard.stop()
        await super().cleanup()


def guarded_runner(app: web.Application, limits: ServerLimits, body_limit: int,
                   **kwargs: Any) -> GuardedRunner:
    """The node's runner: aiohttp's, with its connections bounded."""
    return GuardedRunner(app, limits, body_limit, **kwargs)
