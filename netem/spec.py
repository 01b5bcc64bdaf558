"""`LinkSpec`: what one link does to the traffic from this node to one peer.

A LinkSpec is ONE-WAY: it shapes the packets this node sends to one peer (egress). The round
trip between A and B is `A→B.delay_ms + B→A.delay_ms`; a topology that gives one symmetric value
sets it on both ends. Units live in the field names; strings such as "20ms" or "1gbit" are parsed
only where people type them (`netem.parse`), never here.

Jitter follows `jitter_dist` (netem's tables, `netem.dist`; uniform in [delay - jitter, delay +
jitter] by default), optionally correlated (`jitter_corr_pct`, netem's rule), and reorders
packets, which makes TCP retransmit: keep it small. Loss is Bernoulli (`loss_pct`) or bursty
(`loss_model`, Gilbert–Elliott, `netem.gemodel`); `schedule` makes the link time-varying
(`netem.schedule`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from moe.vocab import clip
from netem.dist import DISTRIBUTIONS
from netem.errors import BadLinkInput
from netem.gemodel import GeLoss
from netem.schedule import Schedule, Step

__all__ = ["ACCESS_FIELDS", "JSON_FIELDS", "LinkSpec", "check_access", "check_links"]

# The per-peer keys of PUT /v1/links that become a LinkSpec; "address" is the node's business.
JSON_FIELDS = ("delay_ms", "jitter_ms", "rate_mbit", "loss_pct", "queue_pkts", "jitter_dist",
               "jitter_corr_pct", "reorder_pct", "loss_model", "schedule")
# Fields whose defaults are left out of the JSON (so links without them read as before).
_OPTIONAL = {"jitter_dist": "uniform", "jitter_corr_pct": 0.0, "reorder_pct": 0.0,
             "loss_model": None, "schedule": None}
_IGNORED_JSON_FIELDS = frozenset({"address"})

# Bounds that catch typos (a rate in bit/s given as Mbit/s, a delay in µs given as ms).
MAX_DELAY_MS = 60_000.0
MAX_RATE_MBIT = 400_000.0
MAX_QUEUE_PKTS = 1_000_000


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {clip(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {clip(value)}")
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
    jitter_dist: uniform | normal | pareto | paretonormal (netem's tables; jitter_ms is
        their sigma).
    jitter_corr_pct: netem's correlation of each jitter draw with the previous one (0..100).
    reorder_pct: share of packets sent at once, ahead of the delayed ones (netem's `reorder`
        with gap 1); needs delay_ms > 0. The app backend cannot reorder inside a TCP stream
        and says so in its snapshot.
    loss_model: Gilbert–Elliott burst loss instead of loss_pct (not both).
    schedule: steps over time that change delay / rate / loss (`netem.schedule`).
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float = 1000.0
    loss_pct: float = 0.0
    queue_pkts: int | None = None
    jitter_dist: str = "uniform"
    jitter_corr_pct: float = 0.0
    reorder_pct: float = 0.0
    loss_model: GeLoss | None = None
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        delay = _number("delay_ms", self.delay_ms)
        jitter = _number("jitter_ms", self.jitter_ms)
        rate = _number("rate_mbit", self.rate_mbit)
        loss = _number("loss_pct", self.loss_pct)
        if delay < 0 or delay > MAX_DELAY_MS:
            raise ValueError(f"delay_ms must be in 0..{MAX_DELAY_MS:g}, got {clip(self.delay_ms)}")
        if jitter < 0:
            raise ValueError(f"jitter_ms must be >= 0, got {clip(self.jitter_ms)}")
        if jitter > delay:
            raise ValueError(
                f"jitter_ms ({clip(self.jitter_ms)}) must not exceed delay_ms "
                f"({clip(self.delay_ms)})"
            )
        if rate <= 0 or rate > MAX_RATE_MBIT:
            raise ValueError(
                f"rate_mbit must be > 0 and <= {MAX_RATE_MBIT:g}, got {clip(self.rate_mbit)}"
            )
        if loss < 0 or loss > 100:
            raise ValueError(f"loss_pct must be in 0..100, got {clip(self.loss_pct)}")
        if self.queue_pkts is not None and (
            isinstance(self.queue_pkts, bool)
            or not isinstance(self.queue_pkts, int)
            or not 1 <= self.queue_pkts <= MAX_QUEUE_PKTS
        ):
            raise ValueError(
                f"queue_pkts must be None or an integer in 1..{MAX_QUEUE_PKTS}, "
                f"got {clip(self.queue_pkts)}"
            )
        # Normalise ints to floats so equal specs compare and hash equal.
        for name, value in (("delay_ms", delay), ("jitter_ms", jitter),
                            ("rate_mbit", rate), ("loss_pct", loss)):
            object.__setattr__(self, name, value)
        self._check_extras()

    def _check_extras(self) -> None:
        if self.jitter_dist not in DISTRIBUTIONS:
            raise ValueError(f"jitter_dist must be one of {', '.join(DISTRIBUTIONS)}, "
                             f"got {clip(self.jitter_dist)}")
        for name in ("jitter_corr_pct", "reorder_pct"):
            value = _number(name, getattr(self, name))
            if not 0 <= value <= 100:
                raise ValueError(f"{name} must be in 0..100, got {clip(value)}")
            object.__setattr__(self, name, value)
        if self.reorder_pct > 0 and self.delay_ms == 0:
            raise ValueError("reorder_pct needs delay_ms > 0 (netem reorders by not delaying)")
        if self.loss_model is not None:
            if not isinstance(self.loss_model, GeLoss):
                raise ValueError(f"loss_model must be a GeLoss, got {clip(self.loss_model)}")
            if self.loss_pct not in (0.0, 100.0):
                raise ValueError("give loss_pct or loss_model, not both")
        if self.schedule is not None:
            if not isinstance(self.schedule, Schedule):
                raise ValueError(f"schedule must be a Schedule, got {clip(self.schedule)}")
            for i, step in enumerate(self.schedule.steps):
                try:
                    self.at_step(step)
                except ValueError as exc:
                    where = f" ({self.schedule.source})" if self.schedule.source else ""
                    raise ValueError(f"schedule step {i} (t_s={step.t_s:g}){where}: {exc}"
                                     ) from None

    def at_step(self, step: Step) -> LinkSpec:
        """This link as it is during one schedule step (without the schedule)."""
        changes: dict[str, Any] = {"schedule": None}
        for name in ("delay_ms", "rate_mbit", "loss_pct"):
            value = getattr(step, name)
            if value is not None:
                changes[name] = value
        if changes.get("loss_pct") and self.loss_model is not None:
            changes["loss_model"] = None
        return replace(self, **changes)

    def at(self, t_s: float) -> LinkSpec:
        """This link t_s seconds after it was applied (itself when it has no schedule)."""
        if self.schedule is None:
            return self
        return self.at_step(self.schedule.steps[self.schedule.index_at(t_s)])

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkSpec:
        """Build from one per-peer object of PUT /v1/links; unknown keys are errors.

        Numbers only (no "20ms" strings: JSON is typed). "address" is accepted and ignored here
        (the caller passes it to `Shaper.apply` separately).
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a link must be a JSON object, got {clip(data)}")
        unknown = sorted(set(data) - set(JSON_FIELDS) - _IGNORED_JSON_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown link field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(JSON_FIELDS)}, address"
            )
        kwargs = {k: data[k] for k in JSON_FIELDS if k in data}
        if kwargs.get("loss_model") is not None:
            kwargs["loss_model"] = GeLoss.from_json(kwargs["loss_model"])
        if kwargs.get("schedule") is not None:
            kwargs["schedule"] = Schedule.from_json(kwargs["schedule"])
        return cls(**kwargs)

    def to_json(self, full: bool = False) -> dict[str, Any]:
        """The JSON object `from_json` reads back: queue_pkts and unused extras omitted, unless
        `full` (every field, None included: for comparing two links field by field)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("loss_model", "schedule")}
        if out["queue_pkts"] is None and not full:
            del out["queue_pkts"]
        for name, default in _OPTIONAL.items():
            value = getattr(self, name)
            if value != default or full:
                out[name] = value.to_json() if hasattr(value, "to_json") else value
            else:
                out.pop(name, None)
        return out

    def dilated(self, factor: float) -> LinkSpec:
        """This link in emulated time: delays x factor, rate / factor (docs/cost-model.md)."""
        factor = _number("time_dilation", factor)
        if factor <= 0:
            raise ValueError(f"time_dilation must be > 0, got {clip(factor)}")
        if factor == 1.0:
            return self
        return replace(
            self,
            delay_ms=self.delay_ms * factor,
            jitter_ms=self.jitter_ms * factor,
            rate_mbit=self.rate_mbit / factor,
            schedule=None if self.schedule is None else self.schedule.scaled(factor),
        )

    def serialisation_ms(self, nbytes: int) -> float:
        """Time to put nbytes on this link at its rate, in ms."""
        return nbytes * 8 / (self.rate_mbit * 1e3)


def check_links(links: Mapping[str, LinkSpec]) -> dict[str, LinkSpec]:
    """Validate a peer -> LinkSpec mapping (shared by both backends)."""
    if not isinstance(links, Mapping):
        raise BadLinkInput(f"links must be a mapping of peer name to LinkSpec, got {clip(links)}")
    out: dict[str, LinkSpec] = {}
    for peer, spec in links.items():
        if not isinstance(peer, str) or not peer:
            raise BadLinkInput(f"peer names must be non-empty strings, got {clip(peer)}")
        if not isinstance(spec, LinkSpec):
            raise BadLinkInput(f"link to {clip(peer)} must be a LinkSpec, got {clip(spec)}")
        out[peer] = spec
    return out


# A node's access link, each way: the rates (Mbit/s) a topology node, PUT /v1/links and a
# shaper's `apply` take by these names.
ACCESS_FIELDS = ("uplink_mbit", "downlink_mbit")


def check_access(rate_mbit: object, field: str = "uplink_mbit") -> float | None:
    """One of a node's access-link rates in Mbit/s (`field`: uplink_mbit or downlink_mbit;
    None: none), validated (shared by both backends)."""
    if rate_mbit is None:
        return None
    if (isinstance(rate_mbit, bool) or not isinstance(rate_mbit, int | float)
            or not math.isfinite(rate_mbit) or not rate_mbit > 0):
        raise BadLinkInput(f"{field} must be a rate > 0, got {clip(rate_mbit)}")
    return float(rate_mbit)
