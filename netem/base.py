"""The seam between link shaping (`netem`) and the edge node (`services`).

A `Shaper` owns the egress shaping of ONE node: one LinkSpec (one-way, this node → peer) per
peer. Two backends implement it:

- `tc` (`netem.tc.TcShaper`): real kernel qdiscs (htb + netem + u32) in the node's network
  namespace, set through pyroute2. `transmit` returns at once: the kernel does the shaping.
- `app` (`netem.app.AppShaper`): the same links emulated in the node's own HTTP transport, for
  hosts without sch_netem or NET_ADMIN. The node calls `transmit(peer, nbytes)` before each send
  (client side: before a request to peer; server side: before answering a requester).

The node owns the shaper's life: `make_shaper(...)`, `await apply(...)` on every PUT /v1/links
and at start-up, `await close()` on shutdown.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from netem.errors import LinkDownError
from netem.spec import LinkSpec

__all__ = ["BACKENDS", "LinkDownError", "Shaper", "make_shaper"]

log = logging.getLogger("moemesh.netem")

BACKENDS = ("tc", "app", "auto")


@runtime_checkable
class Shaper(Protocol):
    """Per-peer egress shaping of one node. All methods may be called from one event loop."""

    backend: str  # "tc" or "app"
    time_dilation: float  # every emulated delay / serialisation time is multiplied by it

    async def apply(
        self, links: Mapping[str, LinkSpec], addresses: Mapping[str, str] | None = None,
        *, uplink_mbit: float | None = None, downlink_mbit: float | None = None,
    ) -> None:
        """Make `links` (peer name -> spec) the full set; unlisted peers lose their shaping.

        Idempotent; every listed link ends up (not down). `addresses` (peer name -> IPv4) is
        required by `tc` for every peer and ignored by `app`. `uplink_mbit`: the node's access
        link, which every send shares before its per-pair link; `downlink_mbit`: its
        receiving side, which every message from a shaped peer shares after the sender's
        links (None: none). Bad input raises before anything changes.
        """
        ...

    async def set_link(self, peer: str, spec: LinkSpec) -> None:
        """Replace one known peer's link with the full new spec, up (unknown peer: ValueError)."""
        ...

    async def link_down(self, peer: str) -> None:
        """Cut the link to peer: loss 100% (tc) / blackhole (app). Connections survive."""
        ...

    async def link_up(self, peer: str) -> None:
        """Restore peer's link to its spec."""
        ...

    async def clear(self) -> None:
        """Remove all shaping; leaves nothing behind (no qdisc, no state)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """What is applied now: {"backend", "time_dilation", "links": {peer: {...spec, "down"}}}."""
        ...

    def uplink_backlog_s(self) -> float:
        """How long a send handed over now waits for the access link to drain what is queued
        on it (seconds, time dilation included; 0 without an access link). app: its FIFO;
        tc: 0 (the kernel's queue is not read)."""
        ...

    def uplink_backlog_bytes(self) -> int:
        """The bytes queued on the access link (what a kernel's qdisc statistics give; a
        router that learns its access link's rate divides them by that). app: its FIFO;
        tc: 0 (the kernel's queue is not read)."""
        ...

    async def transmit(self, peer: str, nbytes: int, *, timeout_s: float | None = None) -> None:
        """Wait as sending nbytes to peer would (app); return at once (tc).

        app: on a down link, wait until it is up again for at most timeout_s (default the
        shaper's `down_timeout_s`, 30 s), then raise LinkDownError. Unknown peers: no wait.
        """
        ...

    async def schedule(self, peer: str, nbytes: int, *, at: float | None = None,
                       timeout_s: float | None = None) -> float | None:
        """The `now()` time at which nbytes handed to the link at `at` (default now) arrive
        at peer, without waiting for it (app): the receiver waits, so the host's own transfer
        time hides under the emulated delay. None where nothing is shaped in-process (tc, an
        unknown peer). A down link is waited out first, as in `transmit`.
        """
        ...

    async def schedule_span(self, peer: str, nbytes: int, *, at: float | None = None,
                            timeout_s: float | None = None) -> tuple[float, float] | None:
        """`schedule` with the first bytes' arrival too: (first, last) (app); None (tc)."""
        ...

    async def receive(self, nbytes: int, first: float, last: float) -> float:
        """When a message from a shaped peer, its bytes arriving from `first` to `last`, is
        through this node's downlink (app: its FIFO, booked at `first`; tc, or no downlink:
        `last`, at once)."""
        ...

    async def close(self) -> None:
        """Clear and release resources (netlink sockets)."""
        ...


def make_shaper(
    backend: str,
    *,
    netns: str | None = None,
    iface: str | None = None,
    time_dilation: float = 1.0,
    owner: str = "",
) -> Shaper:
    """Build a shaper. backend: "tc", "app" or "auto" (tc when it works here, else app, loudly).

    netns: network namespace name or path (`/proc/PID/ns/net`) for tc; None = this process's.
    iface: interface to shape for tc; None = the one carrying the route to each peer's address
        (resolved on first apply; in a node namespace, its only non-loopback interface).
    owner: the node's name; the app shaper seeds each link's jitter and loss draws with it and
        the peer's, so a run and a link applied afresh draw the same again.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown shaper backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if isinstance(time_dilation, bool) or not isinstance(time_dilation, int | float) or not (
        time_dilation > 0
    ):
        raise ValueError(f"time_dilation must be a number > 0, got {time_dilation!r}")
    if backend == "auto":
        from netem.probe import probe_tc

        verdict = probe_tc(netns=netns)
        if verdict.ok:
            backend = "tc"
            log.warning("shaper auto: using tc (kernel netem works here)")
        else:
            backend = "app"
            log.warning(
                "shaper auto: using app (in-process emulation) because tc cannot work here: %s",
                verdict.reason,
            )
    if backend == "tc":
        from netem.tc import TcShaper

        return TcShaper(netns=netns, iface=iface, time_dilation=float(time_dilation))
    from netem.app import AppShaper

    return AppShaper(time_dilation=float(time_dilation), owner=owner)
