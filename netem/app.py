"""The `app` backend: links emulated inside the node's own HTTP transport.

For hosts where the kernel lacks sch_netem or the process lacks NET_ADMIN. The node calls
`await shaper.transmit(peer, nbytes)` before it sends nbytes to peer (its client before a request,
its server before answering a requester), so each direction is shaped by its sender, as with tc.

The model of one link (one-way, this node → peer):
- a FIFO serialiser at the link rate: a send starts when the previous one has left the wire
  (concurrent sends share the bandwidth), and takes nbytes * 8 / rate;
- then the one-way delay with netem's jitter: the same distribution tables and correlation rule
  (`netem.dist`), from this shaper's seeded generator;
- loss: the message is split into MSS-sized segments; if any is lost (Bernoulli loss_pct, or
  the Gilbert–Elliott chain of `netem.gemodel`, one draw per segment in order) the send stalls
  one retransmission timeout (200 ms x time dilation), doubling per repeated loss of the
  retransmitted segment, like TCP's RTO backoff (with Gilbert–Elliott a retransmission is lost
  with the chain's stationary rate: it goes out an RTO later, when the chain has long mixed, and
  drawing it from the chain would cut the bursts of the first transmissions short). Queue
  limits (tail drop) are not modelled;
- a schedule (`netem.schedule`): the step in force when a message is handed over gives its
  delay and loss; the serialiser runs at each step's rate across step boundaries. t = 0 is when
  the link was applied (as for tc);
- a Mahimahi trace (a schedule with `trace`) replaces the serialiser: the link's FIFO drains
  1,504 bytes at each delivery opportunity of the trace, and a message leaves at the
  opportunity that carries its last byte, as Mahimahi's mm-link delivers (`netem.mahimahi`);
  then the delay, jitter and loss as above. The trace's rate bins are tc's, not used here;
- reorder_pct is not emulated (a TCP stream delivers messages in order); the snapshot lists it
  under "not_emulated".
- an access link (`uplink_mbit`, the node's NIC or uplink): one FIFO serialiser at its rate
  that every send of this node passes before its per-pair link, so sends to different peers
  queue behind each other. The two serialisers are in tandem as a fluid: the pair link starts
  a message when its first bytes have left the uplink and the pair link is free, and finishes
  it no earlier than the uplink does (a message is not stored whole between them). Messages
  to unshaped peers do not use it; a Mahimahi trace link takes the uplink's finish time as
  its hand-over;
- a downlink (`downlink_mbit`, the node's access link for what it receives): one FIFO at its
  rate that every message from a shaped peer crosses last, after the sender's links. The
  sender cannot see it (other senders share it), so the receiver books it: the sender says
  when the message's first and last bytes arrive (`schedule_span`), and the receiver, at the
  first byte's emulated arrival (so messages take the FIFO in the order their bytes come),
  calls `receive`: the message starts when its first bytes are in and the downlink is free,
  and is through no earlier than its last byte arrived (the same fluid tandem as above);
- down (or loss 100%): a blackhole; sends wait until the link comes back, and raise
  `LinkDownError` after `down_timeout_s` (a caller's own timeout usually fires first).
Every wait is deadline-based (`netem.timing`). Peers without a link are not shaped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Mapping
from typing import Any

from netem.dist import CorrelatedRandom, draw_delay_ms
from netem.errors import BadLinkInput, LinkDownError
from netem.gemodel import GeChain
from netem.mahimahi import DeliveryTrace, OpportunityQueue
from netem.spec import LinkSpec, check_access, check_links
from netem.timing import now, sleep_until

__all__ = ["AppShaper"]

RTO_S = 0.2  # Linux's minimum TCP retransmission timeout
MSS_BYTES = 1448  # TCP payload per 1500-byte packet with timestamps
MAX_BACKOFFS = 6
log = logging.getLogger("moemesh.netem")


class AppShaper:
    """In-process emulation of per-peer egress links (see the module docstring)."""

    backend = "app"

    def __init__(
        self,
        *,
        time_dilation: float = 1.0,
        seed: int | None = None,
        down_timeout_s: float = 30.0,
        owner: str = "",
    ) -> None:
        if not time_dilation > 0:
            raise ValueError(f"time_dilation must be > 0, got {time_dilation!r}")
        self.time_dilation = float(time_dilation)
        self.down_timeout_s = float(down_timeout_s)
        self._seed = 0 if seed is None else seed
        self.owner = owner  # the node that sends on these links: part of each link's seed
        self._links: dict[str, LinkSpec] = {}
        self._down: set[str] = set()
        self._free_at: dict[str, float] = {}  # `now()` when each serialiser is free again
        self._changed: dict[str, asyncio.Event] = {}  # set (and replaced) on each change
        self._origin: dict[str, float] = {}  # `now()` when each link was applied (schedules)
        self._jitter: dict[str, CorrelatedRandom] = {}
        self._rngs: dict[str, random.Random] = {}  # per link: jitter, loss and loss stalls
        self._chain: dict[str, GeChain] = {}
        self._queues: dict[str, OpportunityQueue] = {}  # links that follow a Mahimahi trace
        self._emulated: dict[str, tuple[LinkSpec, LinkSpec]] = {}  # peer -> (given, dilated)
        self.uplink_mbit: float | None = None  # the node's access link (None: none)
        self._uplink_free_at = 0.0  # `now()` when the access link is free again
        self.downlink_mbit: float | None = None  # its receiving side (None: none)
        self._downlink_free_at = 0.0
        self.stalls = 0  # sends that paid at least one retransmission timeout
        self.sends = 0

    # -- configuration -------------------------------------------------------------------
    async def apply(
        self, links: Mapping[str, LinkSpec], addresses: Mapping[str, str] | None = None,
        *, uplink_mbit: float | None = None, downlink_mbit: float | None = None,
    ) -> None:
        uplink = check_access(uplink_mbit)
        downlink = check_access(downlink_mbit, "downlink_mbit")
        new = check_links(links)
        if uplink != self.uplink_mbit:
            self.uplink_mbit = uplink
            self._uplink_free_at = 0.0
        if downlink != self.downlink_mbit:
            self.downlink_mbit = downlink
            self._downlink_free_at = 0.0
        old = self._links
        self._links = new
        self._down.clear()
        for peer in set(old) | set(new):
            if old.get(peer) != new.get(peer):
                self._free_at.pop(peer, None)
                self._fresh(peer)
            self._notify(peer)

    async def set_link(self, peer: str, spec: LinkSpec) -> None:
        self._known(peer)
        check_links({peer: spec})
        self._links[peer] = spec
        self._down.discard(peer)
        self._free_at.pop(peer, None)
        self._fresh(peer)
        self._notify(peer)

    def _fresh(self, peer: str) -> None:
        """New link state for peer: schedule clock from now, new jitter and loss chains."""
        spec = self._links.get(peer)
        for table in (self._origin, self._jitter, self._chain, self._queues, self._rngs):
            table.pop(peer, None)
        if spec is None:
            return
        self._origin[peer] = now()
        # each link its own generator, seeded by who sends to whom: a link applied afresh
        # (a new arm's links) draws the same jitter and loss again, so runs repeat
        rng = self._rngs[peer] = self._new_rng(peer)
        self._jitter[peer] = CorrelatedRandom(rng, spec.jitter_corr_pct)
        if spec.loss_model is not None:
            self._chain[peer] = GeChain(spec.loss_model, rng)
        if spec.reorder_pct > 0:
            log.warning("app shaper: reorder_pct %g%% to %s is not emulated (only tc can "
                        "reorder packets)", spec.reorder_pct, peer)

    def _new_rng(self, peer: str) -> random.Random:
        return random.Random(f"{self._seed}:{self.owner}>{peer}")

    def _rng(self, peer: str) -> random.Random:
        rng = self._rngs.get(peer)
        if rng is None:
            rng = self._rngs[peer] = self._new_rng(peer)
        return rng

    def origin(self, peer: str) -> float | None:
        """`now()` when peer's link was applied: t = 0 of its schedule."""
        return self._origin.get(peer)

    async def link_down(self, peer: str) -> None:
        self._known(peer)
        self._down.add(peer)
        self._notify(peer)

    async def link_up(self, peer: str) -> None:
        self._known(peer)
        self._down.discard(peer)
        self._notify(peer)

    async def clear(self) -> None:
        peers = set(self._links)
        self._links = {}
        self._down.clear()
        self._free_at.clear()
        self._queues.clear()
        self.uplink_mbit = self.downlink_mbit = None
        self._uplink_free_at = self._downlink_free_at = 0.0
        for peer in peers:
            self._notify(peer)

    async def close(self) -> None:
        await self.clear()

    def snapshot(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "time_dilation": self.time_dilation,
            **({"uplink_mbit": self.uplink_mbit} if self.uplink_mbit is not None else {}),
            **({"downlink_mbit": self.downlink_mbit} if self.downlink_mbit is not None
               else {}),
            "links": {
                peer: {**spec.to_json(), "down": peer in self._down,
                       **({"not_emulated": ["reorder_pct"]} if spec.reorder_pct else {}),
                       # t = 0 of its schedule (a `now()` value): where a trace stands
                       **({"origin_s": self._origin[peer]}
                          if spec.schedule is not None and peer in self._origin else {})}
                for peer, spec in sorted(self._links.items())
            },
        }

    # -- the data path -------------------------------------------------------------------
    async def transmit(self, peer: str, nbytes: int, *, timeout_s: float | None = None) -> None:
        """Wait as sending nbytes to peer over its link would; see the module docstring.

        timeout_s bounds the wait on a down link (default `down_timeout_s`), then LinkDownError.
        """
        due = await self.schedule(peer, nbytes, timeout_s=timeout_s)
        if due is not None:
            await sleep_until(due)

    async def schedule(self, peer: str, nbytes: int, *, at: float | None = None,
                       timeout_s: float | None = None) -> float | None:
        """When nbytes handed to the link to peer at `at` (a `now()` value; default now)
        arrive there, without waiting for it: the receiver waits (see docs/measurement.md).

        The serialiser, jitter and loss are drawn as `transmit` does; a down link is waited
        out first (the bytes leave when it is back). None: peer is not shaped here.
        """
        span = await self.schedule_span(peer, nbytes, at=at, timeout_s=timeout_s)
        return None if span is None else span[1]

    async def schedule_span(self, peer: str, nbytes: int, *, at: float | None = None,
                            timeout_s: float | None = None) -> tuple[float, float] | None:
        """`schedule`, with when the message's first bytes arrive too: (first, last), what
        the receiver's downlink needs (`receive`). A loss stall delays the last bytes only."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        if peer not in self._links:
            return None
        t = now()
        if self._blocked(peer):
            await self._wait_passable(
                peer, self.down_timeout_s if timeout_s is None else timeout_s)
            t = now()  # nothing left before the link came back
        elif at is not None:
            t = at
        spec = self._links.get(peer)
        if spec is None:  # cleared while we waited
            return None
        full = self._dilated(peer, spec)
        origin = self._origin.setdefault(peer, t)
        link = full.at(t - origin)  # the step in force when the bytes are handed over
        trace = full.schedule.trace if full.schedule is not None else None
        start, up_done = self._uplink(t, nbytes)
        if trace is not None:  # Mahimahi's delivery opportunities
            # to the ns: a hand-over at an opportunity's instant must not fall a rounding
            # error before it (it would catch that opportunity, which Mahimahi spends first)
            rel_ms = round((up_done - origin) * 1e3, 6)
            left_ms = self._queue(peer, trace).deliver(rel_ms, nbytes)
            on_wire = origin + left_ms / 1e3  # the first bytes: no later than at `start`
        else:
            start = max(start, self._free_at.get(peer, start))
            on_wire = max(up_done, _wire_done(full, origin, start, nbytes))
            self._free_at[peer] = on_wire
        delay_ms = link.delay_ms
        if link.jitter_ms > 0:
            jitter = self._jitter.setdefault(peer, CorrelatedRandom(self._rng(peer),
                                                                    link.jitter_corr_pct))
            delay_ms = draw_delay_ms(link.delay_ms, link.jitter_ms, link.jitter_dist,
                                     jitter.next())
        self.sends += 1
        last = on_wire + delay_ms / 1e3 + self._loss_stall_s(peer, link, nbytes)
        return min(start + delay_ms / 1e3, last), last

    async def receive(self, nbytes: int, first: float, last: float) -> float:
        """When a message from a shaped peer whose first bytes arrive at `first` and last at
        `last` (the sender's `schedule_span`) has crossed this node's downlink; `last` without
        one. Waits until `first` before it takes the downlink's FIFO, so messages take it in
        the order their bytes arrive, not the order the host got them."""
        if self.downlink_mbit is None:
            return last
        await sleep_until(first)
        begin = max(min(first, last), self._downlink_free_at)
        done = max(last, begin + nbytes * 8 * self.time_dilation / (self.downlink_mbit * 1e6))
        self._downlink_free_at = done
        return done

    def uplink_backlog_s(self) -> float:
        if self.uplink_mbit is None:
            return 0.0
        return max(0.0, self._uplink_free_at - now())

    def uplink_backlog_bytes(self) -> int:
        if self.uplink_mbit is None:
            return 0
        return int(self.uplink_backlog_s() * self.uplink_mbit * 1e6 / 8 / self.time_dilation)

    def _uplink(self, t: float, nbytes: int) -> tuple[float, float]:
        """(when the message's first bytes leave the access link, when its last do) for a
        message handed over at t; (t, t) without an access link."""
        if self.uplink_mbit is None:
            return t, t
        start = max(t, self._uplink_free_at)
        done = start + nbytes * 8 * self.time_dilation / (self.uplink_mbit * 1e6)
        self._uplink_free_at = done
        return start, done

    def _dilated(self, peer: str, spec: LinkSpec) -> LinkSpec:
        """The link in emulated time, made once per applied spec (a schedule's steps are each
        validated when it is built: too slow to redo per send)."""
        cached = self._emulated.get(peer)
        if cached is None or cached[0] is not spec:
            cached = (spec, spec.dilated(self.time_dilation))
            self._emulated[peer] = cached
        return cached[1]

    def _queue(self, peer: str, trace: DeliveryTrace) -> OpportunityQueue:
        """peer's opportunity FIFO, new when its link (so its dilated trace) is new."""
        queue = self._queues.get(peer)
        if queue is None or queue.trace is not trace:
            queue = self._queues[peer] = OpportunityQueue(trace)
        return queue

    def _loss_stall_s(self, peer: str, link: LinkSpec, nbytes: int) -> float:
        chain = self._chain.get(peer) if link.loss_model is not None else None
        if link.loss_pct <= 0 and chain is None:
            return 0.0
        segments = max(1, math.ceil(nbytes / MSS_BYTES))
        rng = self._rng(peer)
        if chain is not None:  # every segment advances the chain, in order
            lost = sum([chain.lost() for _ in range(segments)]) > 0
            p_again = chain.model.loss_rate()

            def again() -> bool:  # an RTO later the chain has mixed: its stationary loss
                return rng.random() < p_again
        else:
            p_lost = 1.0 - (1.0 - link.loss_pct / 100.0) ** segments
            lost = rng.random() < p_lost

            def again() -> bool:
                return rng.random() < p_lost
        stall, rto = 0.0, RTO_S * self.time_dilation
        for _ in range(MAX_BACKOFFS):
            if not lost:
                break
            stall += rto
            rto *= 2
            lost = again()
        if stall:
            self.stalls += 1
        return stall

    def _blocked(self, peer: str) -> bool:
        spec = self._links.get(peer)
        return spec is not None and (peer in self._down or spec.loss_pct >= 100)

    async def _wait_passable(self, peer: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._blocked(peer):
            left = deadline - loop.time()
            if left <= 0:
                raise LinkDownError(f"link to {peer} is down (waited {timeout_s:g} s)")
            event = self._changed.setdefault(peer, asyncio.Event())
            try:
                async with asyncio.timeout(left):
                    await event.wait()
            except TimeoutError:
                continue

    def _notify(self, peer: str) -> None:
        event = self._changed.pop(peer, None)
        if event is not None:
            event.set()

    def _known(self, peer: str) -> None:
        if peer not in self._links:
            known = ", ".join(sorted(self._links)) or "none"
            raise BadLinkInput(f"unknown peer {peer!r} (links are set for: {known})")


def _wire_done(link: LinkSpec, origin: float, start: float, nbytes: int) -> float:
    """When nbytes that start serialising at `start` have left: each schedule step's rate for
    the part of the message it covers (one rate without a schedule)."""
    if link.schedule is None:
        return start + link.serialisation_ms(nbytes) / 1e3
    bits, rel = nbytes * 8.0, start - origin  # seconds since the link was applied
    for _ in range(100_000):
        rate_bps = link.at(rel).rate_mbit * 1e6
        change = link.schedule.next_change(rel)
        if change is None or rel + bits / rate_bps <= change:
            break
        bits -= (change - rel) * rate_bps
        rel = max(change, math.nextafter(rel, math.inf))
    return origin + rel + bits / rate_bps
