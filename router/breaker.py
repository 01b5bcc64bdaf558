"""Circuit breakers: stop sending to a node or link that keeps failing, probe it later.

    closed ──(`failures` in a row, or `timeouts`──▶ open ──(open_ms passed)──▶ half-open
       ▲      timeouts in sequence)                 ▲                           │ one probe
       │                                            │                           │ may pass
       └────────── an answer (even a late one) ─────┼──────── probe fails ──────┘ (open_ms
                                                                       doubles, up to max)

The router keeps one breaker per node (connection refused, shutting down: the node is gone)
and one per link from the home node (answers lost on the way, links down: the path is cut).
A node is usable when both allow it.

What counts as evidence of a fault (issue 38: load is not a fault):
- a failure (`failure`): a refused or reset connection, a node shutting down, a link
  reported down. `failures` of them in a row open the breaker (1 by default).
- a timeout (`timeout`) only in sequence: a request that times out counts when it was sent
  after the previous timeout was seen, so a burst of requests in flight together that all
  time out is one piece of evidence, not many. `timeouts` such in a row open the breaker.
  A node queued with other homes' work answers late, and its late answer (the dispatcher
  keeps waiting for it in the background) closes the breaker and ends the streak; a cut link
  never answers, so the second timeout of a request sent after the first opens it.
- any answer (`success`), on time or late, closes it.

Time is passed in (ms, monotonic), so tests need no sleeping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .errors import BadRouterInput

__all__ = ["Breaker", "Breakers"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    """One node's or one link's breaker."""

    def __init__(self, failures: int = 3, open_ms: float = 2000.0, max_open_ms: float = 30000.0,
                 timeouts: int = 2):
        if failures < 1 or timeouts < 1 or open_ms <= 0:
            raise BadRouterInput(f"breaker needs failures >= 1, timeouts >= 1 and open_ms > 0, "
                                 f"got {failures}, {timeouts}, {open_ms}")
        self.failures = failures
        self.timeouts = timeouts
        self.base_open_ms = open_ms
        self.max_open_ms = max(max_open_ms, open_ms)
        self.open_ms = open_ms
        self.state = CLOSED
        self.streak = 0
        self.timeout_streak = 0
        self.timed_out_at = -math.inf  # when the last counted timeout was seen
        self.opened_at = 0.0
        self.probing = False
        self.trips = 0

    def usable(self, now_ms: float) -> bool:
        """May a plan use this now? Moves open → half-open when its time has come; a
        half-open breaker is usable until its probe is sent."""
        if self.state == OPEN and now_ms - self.opened_at >= self.open_ms:
            self.state = HALF_OPEN
            self.probing = False
        if self.state == HALF_OPEN:
            return not self.probing
        return self.state == CLOSED

    def usable_at(self, now_ms: float) -> float:
        """When a plan may use this next: now, or when an open breaker goes half-open (a probe
        in flight: now, its answer is due within its limit)."""
        if self.usable(now_ms) or self.state == HALF_OPEN:
            return now_ms
        return self.opened_at + self.open_ms

    def on_send(self) -> None:
        if self.state == HALF_OPEN:
            self.probing = True

    def success(self) -> None:
        self.state = CLOSED
        self.streak = 0
        self.timeout_streak = 0
        self.timed_out_at = -math.inf
        self.probing = False
        self.open_ms = self.base_open_ms

    def failure(self, now_ms: float) -> None:
        self.streak += 1
        if self.state == HALF_OPEN:
            self.open_ms = min(self.open_ms * 2, self.max_open_ms)
            self._open(now_ms)
        elif self.state == CLOSED and self.streak >= self.failures:
            self._open(now_ms)

    def timeout(self, now_ms: float, sent_ms: float) -> bool:
        """A request sent at `sent_ms` timed out at `now_ms`. It counts only when it was sent
        after the last counted timeout was seen (see the module docstring); a half-open
        probe's timeout reopens at once. True when it counted."""
        if self.state == HALF_OPEN and self.probing:
            self.open_ms = min(self.open_ms * 2, self.max_open_ms)
            self._open(now_ms)
            return True
        if sent_ms < self.timed_out_at:
            return False
        self.timed_out_at = now_ms
        self.timeout_streak += 1
        if self.state == CLOSED and self.timeout_streak >= self.timeouts:
            self._open(now_ms)
        return True

    def _open(self, now_ms: float) -> None:
        self.state = OPEN
        self.opened_at = now_ms
        self.probing = False
        self.trips += 1


class Breakers:
    """The node and link breakers of one home node, by node name."""

    def __init__(self, home: str, nodes: Iterable[str], failures: int, open_ms: float,
                 timeouts: int = 2) -> None:
        self.home = home
        self.node = {n: Breaker(failures, open_ms, timeouts=timeouts) for n in nodes}
        self.link = {n: Breaker(failures, open_ms, timeouts=timeouts)
                     for n in nodes if n != home}

    def usable(self, name: str, now_ms: float) -> bool:
        ok = self.node[name].usable(now_ms)
        link = self.link.get(name)
        return (link.usable(now_ms) if link is not None else True) and ok

    def usable_at(self, name: str, now_ms: float) -> float:
        """When both of `name`'s breakers let a plan use it next (see Breaker.usable_at)."""
        link = self.link.get(name)
        return max(self.node[name].usable_at(now_ms),
                   link.usable_at(now_ms) if link is not None else now_ms)

    def on_send(self, name: str) -> None:
        self.node[name].on_send()
        if name in self.link:
            self.link[name].on_send()

    def success(self, name: str) -> None:
        self.node[name].success()
        if name in self.link:
            self.link[name].success()

    def failure(self, name: str, kind: str, now_ms: float) -> None:
        """kind "node": the node itself failed; "link": the path to it did."""
        if kind == "link" and name in self.link:
            self.link[name].failure(now_ms)
        else:
            self.node[name].failure(now_ms)

    def timeout(self, name: str, now_ms: float, sent_ms: float) -> bool:
        """A request to `name` sent at `sent_ms` timed out: its link's breaker (the home's
        own node breaker for the home) counts it, in sequence only (Breaker.timeout)."""
        return self.link.get(name, self.node[name]).timeout(now_ms, sent_ms)

    def states(self) -> dict[str, dict[str, str]]:
        return {
            n: {"node": b.state, "link": self.link[n].state if n in self.link else "local"}
            for n, b in self.node.items()
        }
