"""What the router learns of its nodes: one listener the send path tells once per event.

A request leaving (`sent`), an answer (`answered`, on time or late), a request past its limit
(`timed_out`) and a refusal or cut (`refused`) each come here once; this module updates the
estimators (what a branch costs), the circuit breakers (whether a node may be used) and the
plan view (router.tables: what the policies see), and wakes the rows waiting for a node to
come back (`back`). The order of those updates inside each call is the dispatcher's as it
was (it is part of a virtual-time run's result).

It also keeps how late answers come back after their emulated arrival (this host's own
delay, smoothed as TCP smooths RTTs), which every remote request's limit adds.
"""

from __future__ import annotations

import asyncio

from netem.timing import now as clock_now
from services.wire import ForwardResponse

from .breaker import Breakers
from .cost import Breakdown, Estimates
from .estimators import Estimators
from .mesh import Mesh
from .records import Counters
from .tables import PlanView

__all__ = ["SYNC_MS", "Health", "now_ms"]

SYNC_MS = 5.0  # the plan view is refreshed from the estimators at most this often


def now_ms() -> float:
    return clock_now() * 1e3


class Health:
    """The home's beliefs about its nodes (estimators, breakers, lateness) and the plan view
    they feed; shared by all the home's requests."""

    def __init__(self, mesh: Mesh, view: PlanView, counters: Counters) -> None:
        self.home = mesh.home
        self.nodes = list(mesh.nodes)
        self.settings = mesh.settings
        self.view = view
        self.counters = counters
        self.estimators = Estimators(
            mesh.home, {n: info.prior for n, info in mesh.nodes.items()}, mesh.links,
            learn_access=bool(self.settings.learn_access),
        )
        self.breakers = Breakers(
            mesh.home, mesh.nodes, self.settings.breaker_failures, self.settings.breaker_open_ms,
            self.settings.breaker_timeouts,
        )
        self.back: asyncio.Event | None = None  # set when a node's breaker closes
        self.synced_at = -1e18
        self.snapshot: Estimates = self.estimators.estimates()
        self.unscaled: Estimates = self.snapshot.unscaled()  # what each prediction uses
        # how late answers come back after their emulated arrival, smoothed (mean, mean
        # deviation), added to every remote limit so that a busy host slows tokens down
        # instead of timing them out
        self.late_ms = 0.0
        self.late_dev_ms = self.settings.min_request_ms / 4  # the first limits: twice the least

    # -- the plan view ------------------------------------------------------------------------
    def sync(self, force: bool = False) -> None:
        """Refresh the plan view from the estimators and the breakers (throttled)."""
        now = now_ms()
        if not force and now - self.synced_at < SYNC_MS:
            return
        self.synced_at = now
        self.snapshot = self.estimators.estimates(now)
        self.unscaled = self.snapshot.unscaled()
        self.view.refresh(self.snapshot)
        for name in self.nodes:
            self.view.set_up(name, self.breakers.usable(name, now))

    # -- what the send path tells -------------------------------------------------------------
    def sent(self, node: str, predicted: Breakdown, at_ms: float) -> int:
        """A request leaves for `node` (the estimators' in-flight entry, its ticket, and the
        breakers); every ticket ends in `answered` or `dropped`."""
        ticket = self.estimators.sent(node, predicted, at_ms)
        self.on_send(node, at_ms)
        return ticket

    def answered(self, node: str, ticket: int, predicted: Breakdown, res: ForwardResponse,
                 ready: float) -> float:
        """An answer (on time or late, already checked): teach the estimators its timing and
        the node's piggybacked queue state, close the breakers; returns when it was back on
        the emulated timeline."""
        t1 = now_ms()
        arrived = clock_now() if res.arrived is None else res.arrived
        if node != self.home:
            self._observe_lateness(max(0.0, clock_now() - arrived) * 1e3)
            access = self.estimators.access
            if access is not None:  # `learn_access`: the bodies' dispersions (router.access)
                access.observe(node, res.body_bytes[0], res.sent_spread,
                               res.body_bytes[1], res.spread, res.uplink_mbit)
        self.estimators.answered(
            node, ticket, predicted, (arrived - ready) * 1e3,
            {"queue_ms": res.timing.queue_ms, "load_ms": res.timing.load_ms,
             "compute_ms": res.timing.compute_ms},
            {"queue": res.state.queue, "busy_ms": res.state.busy_ms,
             "resident": res.state.resident},
            t1,
        )
        self.on_result(node, None)
        if node != self.home:  # the HTTP bodies, as sent and received
            self.counters.bytes_out += res.body_bytes[0]
            self.counters.bytes_in += res.body_bytes[1]
        return arrived

    def failed(self, node: str, kind: str, timed_out: bool, waiting: bool, cut_short: bool,
               sent_ms: float) -> None:
        """A request failed within its limit (`kind`: `classify`'s; `waiting`: it is still
        waited for in the background; `cut_short`: the layer's deadline cut it, nobody's
        fault)."""
        self.counters.failures += 1
        if node != self.home and timed_out:  # as TCP backs off: the next limit is longer
            self.late_dev_ms = max(2 * self.late_dev_ms, self.settings.min_request_ms / 4)
        if waiting or (timed_out and kind == "link"):
            if not cut_short:
                self.on_timeout(node, sent_ms)
        elif kind != "busy" and not cut_short:
            self.on_result(node, kind)

    def dropped(self, node: str, ticket: int) -> None:
        """A request ended without an answer: its in-flight entry goes."""
        self.estimators.failed(node, ticket)

    # -- the breakers and the view ------------------------------------------------------------
    def on_timeout(self, node: str, sent_ms: float) -> None:
        """A request to `node` sent at `sent_ms` passed its limit: its breaker counts it when
        it is in sequence (router.breaker), and whether plans may use the node."""
        now = now_ms()
        self.breakers.timeout(node, now, sent_ms)
        self.view.set_up(node, self.breakers.usable(node, now))

    def on_send(self, node: str, at_ms: float) -> None:
        """A request leaves for `node`: a half-open breaker lets this one probe through and
        shuts the node to other plans until it is answered."""
        self.breakers.on_send(node)
        if not self.breakers.usable(node, at_ms):
            self.view.set_up(node, False)

    def on_result(self, node: str, failed: str | None) -> None:
        """`node` answered (None) or failed (`classify`'s kind; the caller leaves out what
        is nobody's fault): its breakers and whether plans may use it. A node that comes
        back wakes the rows waiting for a replica (`back`)."""
        now = now_ms()
        was = self.breakers.usable(node, now)
        if failed is None:
            self.breakers.success(node)
        else:
            self.breakers.failure(node, failed, now)
        up = self.breakers.usable(node, now)
        self.view.set_up(node, up)
        if up and not was and self.back is not None:
            self.back.set()
            self.back = None

    def _observe_lateness(self, late_ms: float) -> None:
        """Fold one answer's lateness in (RFC 6298's gains: 1/8 for the mean, 1/4 for the
        deviation)."""
        self.late_dev_ms += 0.25 * (abs(late_ms - self.late_ms) - self.late_dev_ms)
        self.late_ms += 0.125 * (late_ms - self.late_ms)
