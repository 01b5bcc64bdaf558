"""The node's links: what `PUT /v1/links` gave it, applied through a `netem` shaper.

`netem` owns shaping; this module owns the node's side of the seam (netem/base.py): parse the
body whole (nothing is applied if one link is bad), build a shaper for the asked backend,
apply, and keep the last accepted body so a restarted node re-applies it (a restarted container
has lost its qdiscs). The `app` backend shapes in the node's transport: the node's client calls
`transmit(peer, n)` before a request, the server before answering a requester that named
itself (`X-Moemesh-From`), so each direction is shaped by its sender, as with tc.

Building a shaper may block (`auto` probes the kernel, `tc` imports pyroute2 on first use):
with `offload` (the node's control thread) that runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from netem import BACKENDS, BackendUnavailable, LinkSpec, NetemError, Shaper, make_shaper
from netem.spec import ACCESS_FIELDS, check_access

from .clock import now, on_shared_clock, sleep_until
from .errors import BadRequest, DoesNotFit, ServiceError

__all__ = ["ARRIVE_SLACK_S", "Links", "parse_links"]

log = logging.getLogger(__name__)

# Scenario seconds an arrival may lie beyond one message's own link time: a backlog on the
# sender's link at overload (capacity ladders), retransmission back-off, a jitter tail. The
# driver gives up on a token after 10 s, so no answer waited for is further ahead than this.
ARRIVE_SLACK_S = 60.0
# On a shared clock, how long after the instant they were asked at the hops of that instant
# are booked (`Links.book_hop`): past the loop's clock resolution (1 ns), so the clock has
# moved on and every hop of the instant is in. No emulated time is taken: they book at `at`.
HOP_TURN_S = 1e-6


def parse_links(data: Any) -> tuple[str, dict[str, LinkSpec], dict[str, str], dict[str, float]]:
    """(backend, {peer: spec}, {peer: address}, access) from a PUT /v1/links body; `access`
    holds the node's access-link rates given (`uplink_mbit`: shared by every send to a peer,
    `downlink_mbit`: by every message from one)."""
    if not isinstance(data, Mapping):
        raise BadRequest('links must be a JSON object {"backend": "tc"|"app", "links": {...}}')
    unknown = sorted(set(data) - {"backend", "links", *ACCESS_FIELDS})
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; known: backend, "
                         f"links, {', '.join(ACCESS_FIELDS)}")
    try:
        access = {f: check_access(data[f], f) for f in ACCESS_FIELDS if data.get(f) is not None}
    except ValueError as exc:
        raise BadRequest(str(exc)[:200]) from None
    backend = data.get("backend", "auto")
    if backend not in BACKENDS:
        raise BadRequest(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}"[:200])
    raw = data.get("links")
    if not isinstance(raw, Mapping):
        raise BadRequest("links.links must be an object mapping peer names to link profiles")
    specs: dict[str, LinkSpec] = {}
    addresses: dict[str, str] = {}
    for peer, body in raw.items():
        if not isinstance(peer, str) or not peer:
            raise BadRequest(f"peer names must be non-empty strings, got {peer!r}")
        try:
            specs[peer] = LinkSpec.from_json(body)
        except ValueError as exc:
            raise BadRequest(f"link to {peer}: {exc}") from None
        address = body.get("address") if isinstance(body, Mapping) else None
        if address is not None:
            if not isinstance(address, str):
                raise BadRequest(f"link to {peer}: address must be a string, got {address!r}")
            addresses[peer] = address
    return backend, specs, addresses, access


class Links:
    """One node's shaper and the link set it applies."""

    def __init__(self, *, time_dilation: float = 1.0, netns: str | None = None,
                 offload: Callable[..., Awaitable[Any]] | None = None, owner: str = "") -> None:
        self.time_dilation = time_dilation
        self.owner = owner  # this node's name: seeds the app shaper's per-link draws
        self.netns = netns
        self.offload = offload  # runs a blocking call elsewhere: `await offload(fn, *args)`
        self.shaper: Shaper | None = None
        self._asked = ""  # the backend the last accepted body named
        self.accepted: dict[str, Any] | None = None
        self.specs: dict[str, LinkSpec] = {}  # as accepted (undilated)
        self.access: dict[str, float] = {}  # as accepted: ACCESS_FIELDS given
        self._hops: list[tuple[tuple[float, str, int, str], asyncio.Future]] = []  # `book_hop`
        self._booking: set[asyncio.Task] = set()
        # link sets accepted since the node started: whoever set them (a run's controller,
        # `moemesh fault` by hand) can tell whether someone else did meanwhile
        self.puts = 0

    async def put(self, data: Any) -> dict[str, Any]:
        """Apply a PUT /v1/links body; on any error the previous links stay as they were."""
        backend, specs, addresses, access = parse_links(data)
        shaper = self.shaper
        fresh = shaper is None or backend != self._asked
        try:
            if fresh:
                shaper = await self._make(backend)
            await shaper.apply(specs, addresses or None, **access)
        except BackendUnavailable as exc:
            raise DoesNotFit(str(exc), code="backend_unavailable") from None
        except ValueError as exc:  # netem's BadLinkInput: a peer without an address for tc
            raise BadRequest(str(exc)) from None
        except NetemError as exc:
            raise ServiceError(f"shaper failed: {exc}") from None
        if fresh and self.shaper is not None:
            await self._close(self.shaper)
        self.shaper, self._asked = shaper, backend
        self.specs = dict(specs)
        self.accepted = {"backend": backend, "links": {
            p: {**s.to_json(), **({"address": addresses[p]} if p in addresses else {})}
            for p, s in specs.items()
        }, **access}
        self.access = access
        self.puts += 1
        return self.snapshot()

    async def _make(self, backend: str) -> Shaper:
        if self.offload is None:
            return self._make_now(backend)
        return await self.offload(self._make_now, backend)

    def _make_now(self, backend: str) -> Shaper:
        return make_shaper(backend, netns=self.netns, time_dilation=self.time_dilation,
                           owner=self.owner)

    def horizon_s(self, nbytes: int) -> float:
        """How far ahead of now (wall seconds) a message of `nbytes` may say it arrives
        (`X-Moemesh-Arrive`): the longest delay (4 jitters included) and the slowest rate of
        any link of this node, schedule steps included, plus ARRIVE_SLACK_S, all times the
        time dilation. Links are taken as symmetric: this node knows its own egress only."""
        delay_ms, rate_mbit = 0.0, math.inf
        for spec in self.specs.values():
            steps = spec.schedule.steps if spec.schedule is not None else ()
            delays = [spec.delay_ms, *(s.delay_ms for s in steps if s.delay_ms is not None)]
            rates = [spec.rate_mbit, *(s.rate_mbit for s in steps if s.rate_mbit)]
            delay_ms = max(delay_ms, max(delays) + 4 * spec.jitter_ms)
            rate_mbit = min(rate_mbit, *rates)
        for rate in self.access.values():  # a message also crosses the access links
            rate_mbit = min(rate_mbit, rate)
        wire_s = nbytes * 8 / (rate_mbit * 1e6) if math.isfinite(rate_mbit) else 0.0
        return (delay_ms / 1000 + wire_s + ARRIVE_SLACK_S) * self.time_dilation

    def uplink_backlog_s(self) -> float:
        """What the node's access link still has to send (`netem.base.Shaper`); 0 without
        a shaper."""
        return self.shaper.uplink_backlog_s() if self.shaper is not None else 0.0

    def uplink_backlog_bytes(self) -> int:
        """The bytes queued on the node's access link (`netem.base.Shaper`); 0 without one."""
        return self.shaper.uplink_backlog_bytes() if self.shaper is not None else 0

    def snapshot(self) -> dict[str, Any]:
        applied = self.shaper.snapshot() if self.shaper is not None else None
        return {"accepted": self.accepted, "applied": applied, "puts": self.puts}

    async def transmit(self, peer: str, nbytes: int, timeout_s: float | None = None) -> None:
        """Wait as sending nbytes to peer would (app backend); at once otherwise."""
        if self.shaper is not None:
            await self.shaper.transmit(peer, nbytes, timeout_s=timeout_s)

    async def schedule_span(self, peer: str, nbytes: int, *, at: float | None = None,
                            timeout_s: float | None = None) -> tuple[float, float] | None:
        """When the first and the last of nbytes sent to peer at `at` arrive there (app
        backend; the receiver waits, through its downlink from the first); None when nothing
        here delays them (tc, no shaper, an unshaped peer)."""
        if self.shaper is None:
            return None
        return await self.shaper.schedule_span(peer, nbytes, at=at, timeout_s=timeout_s)

    async def book_hop(self, peer: str, nbytes: int, at: float, order: str = ""
                       ) -> tuple[float, float] | None:
        """`schedule_span` for a hop asked of this node (`POST /v1/hop`). On a shared clock
        the hops asked at one instant are booked once it has passed, in the order of (at,
        peer, bytes, order): the requests of two routers whose answers left one batch here
        reach this node in the host's order, which would decide who takes its uplink first;
        `order` (the requester's name for its request) tells apart two hops alike in the
        rest, e.g. two requests' rows from one stage to the next."""
        if not on_shared_clock():
            return await self.schedule_span(peer, nbytes, at=at)
        fut = asyncio.get_running_loop().create_future()
        self._hops.append(((at, peer, nbytes, order), fut))
        if len(self._hops) == 1:
            self._keep(self._book_hops())
        return await fut

    async def _book_hops(self) -> None:
        await sleep_until(now() + HOP_TURN_S)
        held, self._hops = sorted(self._hops, key=lambda h: h[0]), []
        for (at, peer, nbytes, _), fut in held:  # each starts in this order (a down link waits)
            self._keep(self._book_one(peer, nbytes, at, fut))

    async def _book_one(self, peer: str, nbytes: int, at: float, fut: asyncio.Future) -> None:
        if fut.done():  # its requester is gone: nothing is sent
            return
        try:
            span = await self.schedule_span(peer, nbytes, at=at)
        except Exception as exc:  # LinkDownError and the like: the hop's own answer
            if not fut.done():
                fut.set_exception(exc)
            return
        if not fut.done():
            fut.set_result(span)

    def _keep(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._booking.add(task)
        task.add_done_callback(self._booking.discard)

    async def receive(self, nbytes: int, first: float, last: float) -> float:
        """When a message from a shaped peer, its bytes arriving from `first` to `last`, is
        through this node's downlink (netem.base.Shaper.receive); `last` without a shaper."""
        if self.shaper is None:
            return last
        return await self.shaper.receive(nbytes, first, last)

    async def close(self) -> None:
        if self.shaper is not None:
            await self._close(self.shaper)
            self.shaper = None

    @staticmethod
    async def _close(shaper: Shaper) -> None:
        try:
            await shaper.close()
        except NetemError as exc:  # clean-up goes on; say what was left
            log.warning("closing the %s shaper failed: %s", shaper.backend, exc)
