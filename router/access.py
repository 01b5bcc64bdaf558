"""Access links learnt from dispersion (`Settings.learn_access`), not told by the mesh.

A node's access link (its `uplink_mbit`, shared by all it sends; `downlink_mbit`, by all it
receives) is what a router pricing a burst of requests most needs and what a real one is
least likely to be told. Learning it uses the oldest trick of bandwidth estimation (packet
pair and packet train dispersion: Keshav 1991, Dovrolis et al. 2001; BBR's delivery rate): a
message's bytes leave the path's slowest hop one after another, so the time from its first
bytes' arrival to its last is its size over that hop's rate, whatever the propagation delay
and whatever queue it waited in before its first byte went out.

Each remote answer brings two such samples: the request's own dispersion at the peer (its
`X-Moemesh-Spread` header, `services.wire.SPREAD_HEADER`), the rate of the path home → peer,
`min(uplink_home, link(home→peer), downlink_peer)`, and the answer's dispersion here, the
rate of peer → home, `min(uplink_peer, link(peer→home), downlink_home)`. Per path the
estimate is the largest rate of its last `WINDOW` samples (a message that shared a hop with
another one is spread wider, so the maximum is the least disturbed: BBR's windowed-max
filter). The link rates are the topology's (the router is told those), so:

- the home's uplink is the best path out, where that path's own link would have been faster
  (by `MARGIN`): some access link, and the home's is the one every path out shares;
  otherwise no uplink is believed (none that limits a single message);
- a peer's downlink is its path out's rate, where that is below both its link and the home's
  believed uplink: the peer's own access link is then what limits it;
- on the paths back, a slow path is the peer's uplink or the home's downlink, and from the
  home alone the two look alike (every peer behind the same 4 Mbit/s uplink reads as one
  4 Mbit/s downlink here). A peer whose router learns too tells its own learnt uplink with
  its answers (`X-Moemesh-Uplink`, `services.wire.UPLINK_HEADER`): the home's downlink is the
  best path back that runs below its peer's told uplink (and its link), and a peer's uplink
  is what it told; a peer that tells nothing gets its path's rate as its uplink where the
  home's downlink does not explain it, and no downlink is believed from such paths.

What a single message cannot show is not learnt: an uplink faster than every link, which
only a burst of messages to several peers at once fills. Messages too small for their spread
to be measured (below `MIN_BYTES` or `MIN_SPREAD_S`) teach nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

__all__ = ["MARGIN", "MIN_BYTES", "MIN_SPREAD_S", "WINDOW", "AccessLearner"]

WINDOW = 16  # samples per path the estimate is the maximum of
MARGIN = 0.1  # a path this much below its link's rate is limited by an access link
MIN_BYTES = 512  # smaller messages' spread is a rounding error
MIN_SPREAD_S = 1e-6


class AccessLearner:
    """One home's learnt access links (see the module docstring). `link_mbit[(a, b)]`: the
    told rate of the one-way link a→b (in the router's time units, as `LinkEstimate`)."""

    def __init__(self, home: str, link_mbit: Mapping[tuple[str, str], float]) -> None:
        self.home = home
        self.link_mbit = dict(link_mbit)
        self._out: dict[str, deque[float]] = {}  # peer -> rates home → peer, Mbit/s
        self._back: dict[str, deque[float]] = {}  # peer -> rates peer → home
        self._told: dict[str, float] = {}  # peer -> the uplink it learnt for itself
        self._cache: dict[str, tuple[float | None, float | None]] | None = None
        self.samples = 0

    def observe(self, peer: str, sent_bytes: int, sent_spread_s: float | None,
                answer_bytes: int, answer_spread_s: float | None,
                told_uplink: float | None = None) -> None:
        """One answer's two samples (either may be missing: None), and the uplink the peer
        told it learnt for itself (None: it told none; inf: it believes none limits it)."""
        if told_uplink is not None and told_uplink > 0 and self._told.get(peer) != told_uplink:
            self._told[peer] = told_uplink
            self._cache = None
        for paths, nbytes, spread in ((self._out, sent_bytes, sent_spread_s),
                                      (self._back, answer_bytes, answer_spread_s)):
            if spread is None or nbytes < MIN_BYTES or spread < MIN_SPREAD_S:
                continue
            paths.setdefault(peer, deque(maxlen=WINDOW)).append(nbytes * 8 / (spread * 1e6))
            self.samples += 1
            self._cache = None

    def rates(self) -> dict[str, tuple[float | None, float | None]]:
        """node -> (uplink, downlink) Mbit/s as learnt so far (None: none believed)."""
        if self._cache is None:
            self._cache = self._derive()
        return self._cache

    def _derive(self) -> dict[str, tuple[float | None, float | None]]:
        out = {p: max(r) for p, r in self._out.items()}
        back = {p: max(r) for p, r in self._back.items()}
        home, told = self.home, self._told
        up = self._shared(out, lambda p: self.link_mbit.get((home, p)))
        # a path back says the home's downlink only below what its peer's own uplink allows
        below = {p: r for p, r in back.items() if p in told and r < (1 - MARGIN) * told[p]}
        down = self._shared(below, lambda p: self.link_mbit.get((p, home)))
        learnt: dict[str, tuple[float | None, float | None]] = {home: (up, down)}
        for peer in sorted(set(out) | set(back) | set(told)):
            if peer in told:  # inf: it believes no uplink limits it
                own_up = told[peer] if math.isfinite(told[peer]) else None
            else:
                own_up = self._own(back.get(peer), self.link_mbit.get((peer, home)), down)
            learnt[peer] = (own_up,
                            self._own(out.get(peer), self.link_mbit.get((home, peer)), up))
        return learnt

    @staticmethod
    def _shared(rates: dict[str, float], link) -> float | None:
        """The home's side of every path: the best path's rate, where an access link (not
        its own link) limits it."""
        if not rates:
            return None
        peer = max(rates, key=lambda p: (rates[p], p))
        told = link(peer)
        best = rates[peer]
        return best if told is None or best < (1 - MARGIN) * told else None

    @staticmethod
    def _own(rate: float | None, told: float | None, home_side: float | None) -> float | None:
        """A peer's side of its path: its rate, where neither its link nor the home's access
        link limits it."""
        if rate is None:
            return None
        bound = min(x for x in (told, home_side, float("inf")) if x is not None)
        return rate if rate < (1 - MARGIN) * bound else None
