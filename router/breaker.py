"""Circuit breakers: stop sending to a node or link that keeps failing, probe it later.

    closed ──(`failures` in a row)──▶ open ──(open_ms passed)──▶ half-open
       ▲                                ▲                           │ one probe may pass
       └────────── probe succeeds ──────┼──────── probe fails ──────┘ (open_ms doubles,
                                                                     up to max_open_ms)

The router keeps one breaker per node (connection refused, shutting down: the node is gone)
and one per link from the home node (timeouts, answers lost on the way: the path is cut).
A node is usable when both allow it. Time is passed in (ms, monotonic), so tests need no
sleeping.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import BadRouterInput

__all__ = ["Breaker", "Breakers"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    """One node's or one link's breaker."""

    def __init__(self, failures: int = 3, open_ms: float = 2000.0, max_open_ms: float = 30000.0):
        if failures < 1 or open_ms <= 0:
            raise BadRouterInput(f"breaker needs failures >= 1 and open_ms > 0, got "
                                 f"{failures}, {open_ms}")
        self.failures = failures
        self.base_open_ms = open_ms
        self.max_open_ms = max(max_open_ms, open_ms)
        self.open_ms = open_ms
        self.state = CLOSED
        self.streak = 0
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
        self.probing = False
        self.open_ms = self.base_open_ms

    def failure(self, now_ms: float) -> None:
        self.streak += 1
        if self.state == HALF_OPEN:
            self.open_ms = min(self.open_ms * 2, self.max_open_ms)
            self._open(now_ms)
        elif self.state == CLOSED and self.streak >= self.failures:
            self._open(now_ms)

    def _open(self, now_ms: float) -> None:
        self.state = OPEN
        self.opened_at = now_ms
        self.probing = False
        self.trips += 1


class Breakers:
    """The node and link breakers of one home node, by node name."""

    def __init__(self, home: str, nodes: Iterable[str], failures: int, open_ms: float) -> None:
        self.home = home
        self.node = {n: Breaker(failures, open_ms) for n in nodes}
        self.link = {n: Breaker(failures, open_ms) for n in nodes if n != home}

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

    def states(self) -> dict[str, dict[str, str]]:
        return {
            n: {"node": b.state, "link": self.link[n].state if n in self.link else "local"}
            for n, b in self.node.items()
        }
