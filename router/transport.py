"""How the dispatcher reaches a node: the services client over HTTP, or the home node's own
request path in-process (`Node.forward`, no HTTP for local items), behind one `forward` call.

Failures are sorted into three kinds for the circuit breakers (`classify`):
"node" (refused connection, shutting down, not placed: the node is the problem), "link"
(timeouts, an answer lost on the way back: the path is the problem) and "busy" (503
overloaded: try elsewhere, but nothing is broken).

A peer that answers any other 4xx or 5xx (400 malformed, 401, 413, 500 internal) is not a
network fault: `is_bug` says so, the dispatcher opens no breaker, does not replan and fails
the request with the peer's message (`router.errors.PeerBug`). Only 503 (overloaded,
shutting down, an injected fault, a link down) and 404 not_placed (a node revived before its
placement came back) stay faults.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from services.client import NodeClient
from services.errors import NodeRefused, NodeTimeout, NodeUnreachable, ServiceError
from services.wire import ForwardResponse, Group

__all__ = ["RETRYABLE", "MeshTransport", "Transport", "classify", "is_bug"]

# What makes the dispatcher replan; anything else is a bug and fails the token loudly.
RETRYABLE = (NodeUnreachable, NodeTimeout, NodeRefused, ServiceError, TimeoutError,
             ConnectionError)


class Transport(Protocol):
    async def forward(
        self, node: str, groups: Sequence[Group], req: str, timeout_s: float,
        ready: float | None = None,
    ) -> ForwardResponse:
        """Groups (rows once, with their experts) to node; `ready`: when they leave on the
        emulated timeline (default now). The answer's `arrived` is when it is back here on
        that timeline; its `body_bytes` what crossed the wire (0 in-process)."""
        ...


class LocalNode(Protocol):
    """The part of `services.Node` the home node's in-process path uses: the same request
    path as `POST /v1/forward`, without HTTP."""

    async def forward(self, groups: Sequence[Group], arrival: float | None = None) -> Any: ...


def is_bug(exc: BaseException) -> bool:
    """Whether a peer's error answer names a bug (see the module docstring): neither a 503 nor
    a 404 not_placed. In-process `ServiceError`s of the home node are judged alike."""
    if not isinstance(exc, NodeRefused | ServiceError):
        return False
    status = exc.status
    if isinstance(exc, NodeRefused) and status < 400:  # a 200 that could not be decoded
        return False
    return not (status == 503 or (status == 404 and exc.code == "not_placed"))


def classify(exc: BaseException) -> str:
    """"node", "link" or "busy" (see the module docstring)."""
    if isinstance(exc, NodeRefused):
        if exc.status == 503 and exc.code == "overloaded":
            return "busy"
        if exc.code == "link_down":
            return "link"
        return "node"
    if isinstance(exc, ServiceError):  # raised in-process by the home node's device
        return "busy" if exc.code == "overloaded" else "node"
    if isinstance(exc, NodeUnreachable):
        return "node"
    return "link"  # NodeTimeout, TimeoutError, ConnectionError from a shaper


class MeshTransport:
    """Remote nodes through `NodeClient` (shaped by the home node's links when it has an
    `app` shaper); the home node itself through `Node.forward`, in-process."""

    def __init__(
        self,
        home: str,
        urls: Mapping[str, str],
        client: NodeClient,
        local: LocalNode | None = None,
    ) -> None:
        self.home = home
        self.urls = dict(urls)
        self.client = client
        self.local = local

    def uplink_backlog_ms(self) -> float:
        """What the home's access link still has queued (its own answers to other homes'
        tokens included), ms: every send through it starts after that (0 without one)."""
        links = self.client.links
        return 0.0 if links is None else links.uplink_backlog_s() * 1e3

    def uplink_backlog_bytes(self) -> int:
        """The bytes the home's access link still has queued (0 without one)."""
        links = self.client.links
        return 0 if links is None else links.uplink_backlog_bytes()

    async def hop(self, src: str, dst: str, nbytes: int, at: float, timeout_s: float,
                  downlink: bool = True, order: str = "") -> float:
        """When `nbytes` src sends to dst at `at` are there (emulated): src's own shaper, then
        (where dst has a `downlink`) dst's, each in-process on this node and by `POST /v1/hop`
        (`/v1/hop/in`) on another (router.pipeline). The app shaper only. `order`: the
        request's name, which orders hops alike on src (`depart`)."""
        first, last = await self.depart(src, dst, nbytes, at, timeout_s, order)
        if first is None or not downlink:  # not shaped: past no downlink either
            return last
        return await self.land(dst, nbytes, first, last, timeout_s)

    async def depart(self, src: str, dst: str, nbytes: int, at: float, timeout_s: float,
                     order: str = "") -> tuple[float | None, float]:
        """(when the first, when the last of `nbytes` src sends dst at `at` reach dst, its
        downlink not crossed): booked on src's own shaper, in-process on this node and by
        `POST /v1/hop` on another; first None where that link is not shaped. Sends that
        leave one node at one emulated instant take its links in the order they are booked,
        so a caller with several books them one after the other (router.aggregate)."""
        if src != self.home:
            return await self.client.hop(self.urls[src], dst, nbytes, at, timeout_s, order)
        links = self._app_links(src)
        span = (None if links is None
                else await links.schedule_span(dst, nbytes, at=at, timeout_s=timeout_s))
        return (None, at) if span is None else span

    async def land(self, dst: str, nbytes: int, first: float, last: float,
                   timeout_s: float) -> float:
        """When a message arriving at dst from `first` to `last` is through dst's downlink:
        booked on dst (`POST /v1/hop/in`), or in-process on this node."""
        if dst != self.home:
            return await self.client.hop_in(self.urls[dst], nbytes, first, last, timeout_s)
        links = self._app_links(dst)
        return last if links is None else await links.receive(nbytes, first, last)

    def _app_links(self, name: str) -> Any:
        """This node's links (None: none), refused unless the app shaper computes them."""
        links = self.client.links
        shaper = getattr(links, "shaper", None)
        if shaper is not None and shaper.backend != "app":
            raise NodeRefused(name, 409, "hop_needs_app_shaper",
                              f"{name}'s links are shaped by {shaper.backend}, which computes "
                              "no arrival time: a pipelined dense part needs the app shaper")
        return links

    async def forward_at(self, node: str, groups: Sequence[Group], arrival: float,
                         timeout_s: float, answer_to: str | None = None) -> ForwardResponse:
        """Groups already at `node` by `arrival` (emulated), its answer staying there: a
        pipeline stage's own layer (router.pipeline). The home node's in-process path is that
        already; another node's forward is sent with that arrival and answered unshaped, or,
        `answer_to`, shaped toward that node as it leaves (router.aggregate: booked by the
        answering node in its own order, the same in every run)."""
        if node == self.home and self.local is not None:
            return await self.forward(node, groups, "", timeout_s, arrival)
        return await self.client.forward(self.urls[node], groups, timeout_s=timeout_s,
                                         arrive=arrival, answer_to=answer_to)

    async def forward(
        self, node: str, groups: Sequence[Group], req: str, timeout_s: float,
        ready: float | None = None,
    ) -> ForwardResponse:
        if node == self.home and self.local is not None:
            async with asyncio.timeout(timeout_s):
                outs, timing, done, state = await self.local.forward(groups, ready)
            return ForwardResponse(tuple(y for y, _ in outs), timing, state, done)
        return await self.client.forward(
            self.urls[node], groups, req=req, peer=node, timeout_s=timeout_s, ready=ready
        )
