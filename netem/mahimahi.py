"""Mahimahi's link: a delivery-opportunity trace, and the FIFO that drains through it.

Who does what: `parse_trace` reads a trace (plain data, `DeliveryTrace`, carried by a
`netem.schedule.Schedule` so it travels in PUT /v1/links); `OpportunityQueue` is one link's
FIFO in the app backend, which delivers a message when Mahimahi would. The tc backend cannot
release packets at given instants; it follows the trace's rate in bins (`netem.schedule`).

Mahimahi's rule, from its source (ravinet/mahimahi, src/frontend/link_queue.cc,
`LinkQueue::rationalize`, and link_queue.hh, `PACKET_SIZE = 1504`, "default max TUN payload
size"):

- each line of a trace is one delivery opportunity at that millisecond, for up to 1,504 bytes;
  several lines with one timestamp are several opportunities then. The trace repeats with
  period = its last timestamp (at the wrap-around `base_timestamp_ += schedule_.back()`), so a
  trace that starts at 0 has two opportunities at each multiple of the period;
- before a packet is enqueued every opportunity at or before now is spent, on the packets
  queued then or on nothing: a packet handed over at t waits for the first opportunity
  strictly after t (timestamps are whole milliseconds, so this holds for any t);
- an opportunity drains up to 1,504 bytes from the FIFO, in order; a packet leaves at the
  opportunity that carries its last byte. What an opportunity has left after a packet goes to
  the next queued packet (a packet may so span two opportunities); what it has left when the
  queue is empty is lost.

A message of n bytes is handed over whole, so the FIFO drains its bytes in order whatever
packets they travel in (any split into packets of at most 1,504 bytes leaves at the same
opportunity): it leaves at the opportunity that carries its n-th byte, which is ceil(n / 1504)
opportunities for a message that finds the queue empty. As elsewhere in the app backend, n
counts the message's bytes, not TCP/IP headers.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from moe.vocab import clip

__all__ = ["PACKET_BYTES", "DeliveryTrace", "OpportunityQueue", "parse_trace"]

PACKET_BYTES = 1504  # what one opportunity carries (Mahimahi's PACKET_SIZE)
MAX_STAMP_MS = 10_000_000_000  # beyond any real trace: a trace in µs or ns (see parse_trace)


@dataclass(frozen=True)
class DeliveryTrace:
    """Opportunity times in whole ms from the link's start (non-decreasing, the last > 0 being
    the period); `scale` stretches them into emulated time (time dilation)."""

    stamps_ms: tuple[int, ...]
    scale: float = 1.0

    def __post_init__(self) -> None:
        stamps = tuple(self.stamps_ms)
        if not stamps:
            raise ValueError("trace: no timestamps")
        if any(isinstance(s, bool) or not isinstance(s, int) for s in stamps):
            bad = next(s for s in stamps if isinstance(s, bool) or not isinstance(s, int))
            raise ValueError(f"trace: timestamps must be whole milliseconds, got {clip(bad)}")
        if stamps[0] < 0 or any(b < a for a, b in itertools.pairwise(stamps)):
            raise ValueError("trace: timestamps must be >= 0 and never go back in time")
        if stamps[-1] <= 0:
            raise ValueError("trace: the last timestamp (the period) must be after 0 ms")
        if (isinstance(self.scale, bool) or not isinstance(self.scale, int | float)
                or not math.isfinite(self.scale) or self.scale <= 0):
            raise ValueError(f"trace: scale must be a number > 0, got {clip(self.scale)}")
        object.__setattr__(self, "stamps_ms", stamps)
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def period_ms(self) -> float:
        """The repeat period in emulated ms."""
        return self.stamps_ms[-1] * self.scale

    def mean_rate_mbit(self) -> float:
        """The rate the trace offers on average (1,504 bytes per opportunity)."""
        return len(self.stamps_ms) * PACKET_BYTES * 8 / (self.period_ms * 1e3)

    def time_ms(self, j: int) -> float:
        """When opportunity number j (from 0, counting through the repeats) occurs."""
        n = len(self.stamps_ms)
        return ((j // n) * self.stamps_ms[-1] + self.stamps_ms[j % n]) * self.scale

    def first_after(self, t_ms: float) -> int:
        """The number of the first opportunity strictly after t_ms (>= 0)."""
        n, period = len(self.stamps_ms), self.stamps_ms[-1]
        rel = max(0.0, t_ms) / self.scale
        k = math.floor(rel / period)
        j = k * n + bisect.bisect_right(self.stamps_ms, rel - k * period)
        while self.time_ms(j) <= t_ms:  # rounding at a repeat's edge
            j += 1
        return j

    def scaled(self, factor: float) -> DeliveryTrace:
        """In emulated time: every opportunity `factor` times later (each still 1,504 bytes)."""
        return DeliveryTrace(self.stamps_ms, self.scale * factor)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stamps_ms": list(self.stamps_ms)}
        if self.scale != 1.0:
            out["scale"] = self.scale
        return out

    @classmethod
    def from_json(cls, data: Any) -> DeliveryTrace:
        if not isinstance(data, Mapping) or not isinstance(data.get("stamps_ms"), list):
            raise ValueError(f"schedule.trace must be a mapping with a list stamps_ms, got "
                             f"{clip(data)}")
        unknown = sorted(set(data) - {"stamps_ms", "scale"})
        if unknown:
            raise ValueError(f"schedule.trace: unknown field(s) {', '.join(unknown)}; known: "
                             "stamps_ms, scale")
        return cls(tuple(data["stamps_ms"]), data.get("scale", 1.0))


def parse_trace(lines: Iterable[str], source: str = "<trace>",
                max_ms: float = MAX_STAMP_MS) -> DeliveryTrace:
    """A trace from its lines (one whole millisecond per line; blank lines skipped), each error
    naming source and line. A stamp past `max_ms` is refused at its line, before memory grows:
    a Mahimahi trace counts milliseconds, and one in µs or ns would be hours long."""
    stamps: list[int] = []
    for no, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit()):  # the line itself is never quoted
            raise ValueError(f"{source}:{no}: not a whole number of milliseconds (a Mahimahi "
                             f"trace holds one per line)")
        if len(text) > 15 or int(text) > max_ms:
            raise ValueError(
                f"{source}:{no}: a timestamp past the longest trace read here "
                f"({max_ms / 3.6e6:.3g} hours): a Mahimahi trace counts milliseconds; is this "
                f"one in µs or ns? (divide by 1,000 or 1,000,000)")
        value = int(text)
        if stamps and value < stamps[-1]:
            raise ValueError(f"{source}:{no}: goes back in time (before the timestamp of the "
                             "line above)")
        stamps.append(value)
    if not stamps or stamps[-1] <= 0:
        raise ValueError(f"{source}: a trace needs timestamps ending after 0 ms")
    return DeliveryTrace(tuple(stamps))


class OpportunityQueue:
    """One link's FIFO under Mahimahi's rule (module docstring); times in emulated ms since
    the link was applied. Owned by the app shaper, one per link, renewed with the link."""

    def __init__(self, trace: DeliveryTrace) -> None:
        self.trace = trace
        self._last = -1  # the opportunity that carried the latest message's last byte
        self._left = 0  # bytes that opportunity has left for whatever is queued behind

    def deliver(self, t_ms: float, nbytes: int) -> float:
        """When the last of nbytes handed over at t_ms leaves the link (the queue ahead first)."""
        trace = self.trace
        busy = self._last >= 0 and trace.time_ms(self._last) > t_ms  # still queued at t_ms
        if nbytes <= 0:
            return trace.time_ms(self._last) if busy else t_ms
        if busy:
            used = min(self._left, nbytes)
            self._left -= used
            nbytes -= used
            if nbytes == 0:
                return trace.time_ms(self._last)
            first = self._last + 1
        else:
            first = trace.first_after(t_ms)
        count = -(-nbytes // PACKET_BYTES)
        self._last = first + count - 1
        self._left = count * PACKET_BYTES - nbytes
        return trace.time_ms(self._last)
