"""`LinkSpec`: what one link does to the traffic from this node to one peer.

A LinkSpec is ONE-WAY: it shapes the packets this node sends to one peer (egress). The round
trip between A and B is `A→B.delay_ms + B→A.delay_ms`; a topology that gives one symmetric value
sets it on both ends. Units live in the field names; strings such as "20ms" or "1gbit" are parsed
only where people type them (`netem.parse`), never here.

Jitter is uniform in [delay - jitter, delay + jitter] (pyroute2 sets no netem delay distribution)
and reorders packets, which makes TCP retransmit: keep it small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from netem.errors import BadLinkInput

__all__ = ["JSON_FIELDS", "LinkSpec", "check_links"]

# The per-peer keys of PUT /v1/links that become a LinkSpec; "address" is the node's business.
JSON_FIELDS = ("delay_ms", "jitter_ms", "rate_mbit", "loss_pct", "queue_pkts")
_IGNORED_JSON_FIELDS = frozenset({"address"})

# Bounds that catch typos (a rate in bit/s given as Mbit/s, a delay in µs given as ms).
MAX_DELAY_MS = 60_000.0
MAX_RATE_MBIT = 400_000.0
MAX_QUEUE_PKTS = 1_000_000


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LinkSpec:
    """One-way shaping from this node to one peer; validated on construction.

    delay_ms: one-way propagation delay added to every packet (>= 0).
    jitter_ms: uniform +/- variation of the delay (0 <= jitter_ms <= delay_ms).
    rate_mbit: link bandwidth in Mbit/s (> 0), on the wire.
    loss_pct: random packet loss in percent (0..100); 100 is a blackhole.
    queue_pkts: packets the link may hold beyond the bandwidth-delay product;
        None sizes it from the BDP (see `netem.plan.netem_limit`).
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 1000.0
    loss_pct: float = 0.0
    queue_pkts: int | None = None

    def __post_init__(self) -> None:
        delay = _number("delay_ms", self.delay_ms)
        jitter = _number("jitter_ms", self.jitter_ms)
        rate = _number("rate_mbit", self.rate_mbit)
        loss = _number("loss_pct", self.loss_pct)
        if delay < 0 or delay > MAX_DELAY_MS:
            raise ValueError(f"delay_ms must be in 0..{MAX_DELAY_MS:g}, got {self.delay_ms!r}")
        if jitter < 0:
            raise ValueError(f"jitter_ms must be >= 0, got {self.jitter_ms!r}")
        if jitter > delay:
            raise ValueError(
                f"jitter_ms ({self.jitter_ms!r}) must not exceed delay_ms ({self.delay_ms!r})"
            )
        if rate <= 0 or rate > MAX_RATE_MBIT:
            raise ValueError(
                f"rate_mbit must be > 0 and <= {MAX_RATE_MBIT:g}, got {self.rate_mbit!r}"
            )
        if loss < 0 or loss > 100:
            raise ValueError(f"loss_pct must be in 0..100, got {self.loss_pct!r}")
        if self.queue_pkts is not None and (
            isinstance(self.queue_pkts, bool)
            or not isinstance(self.queue_pkts, int)
            or not 1 <= self.queue_pkts <= MAX_QUEUE_PKTS
        ):
            raise ValueError(
                f"queue_pkts must be None or an integer in 1..{MAX_QUEUE_PKTS}, "
                f"got {self.queue_pkts!r}"
            )
        # Normalise ints to floats so equal specs compare and hash equal.
        for name, value in (("delay_ms", delay), ("jitter_ms", jitter),
                            ("rate_mbit", rate), ("loss_pct", loss)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkSpec:
        """Build from one per-peer object of PUT /v1/links; unknown keys are errors.

        Numbers only (no "20ms" strings: JSON is typed). "address" is accepted and ignored here
        (the caller passes it to `Shaper.apply` separately).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a link must be a JSON object, got {data!r}")
        unknown = sorted(set(data) - set(JSON_FIELDS) - _IGNORED_JSON_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown link field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(JSON_FIELDS)}, address"
            )
        kwargs = {k: data[k] for k in JSON_FIELDS if k in data}
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        """The JSON object `from_json` reads back (queue_pkts omitted when None)."""
        out = asdict(self)
        if out["queue_pkts"] is None:
            del out["queue_pkts"]
        return out

    def dilated(self, factor: float) -> LinkSpec:
        """This link in emulated time: delays x factor, rate / factor (docs/cost-model.md)."""
        factor = _number("time_dilation", factor)
        if factor <= 0:
            raise ValueError(f"time_dilation must be > 0, got {factor!r}")
        if factor == 1.0:
            return self
        return replace(
            self,
            delay_ms=self.delay_ms * factor,
            jitter_ms=self.jitter_ms * factor,
            rate_mbit=self.rate_mbit / factor,
        )

    def serialisation_ms(self, nbytes: int) -> float:
        """Time to put nbytes on this link at its rate, in ms."""
        return nbytes * 8 / (self.rate_mbit * 1e3)


def check_links(links: Mapping[str, LinkSpec]) -> dict[str, LinkSpec]:
    """Validate a peer -> LinkSpec mapping (shared by both backends)."""
    if not isinstance(links, Mapping):
        raise BadLinkInput(f"links must be a mapping of peer name to LinkSpec, got {links!r}")
    out: dict[str, LinkSpec] = {}
    for peer, spec in links.items():
        if not isinstance(peer, str) or not peer:
            raise BadLinkInput(f"peer names must be non-empty strings, got {peer!r}")
        if not isinstance(spec, LinkSpec):
            raise BadLinkInput(f"link to {peer!r} must be a LinkSpec, got {spec!r}")
        out[peer] = spec
    return out
