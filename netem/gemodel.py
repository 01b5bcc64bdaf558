"""Burst loss: the Gilbert–Elliott model, as netem's `loss gemodel` runs it.

Two states, good and bad. Per packet (sch_netem.c, `loss_gil_ell`), in the current state: the
state may flip (good→bad with probability p, bad→good with r), and the packet is lost with that
state's loss probability (1 - k in good, 1 - h in bad), the state it was in before the flip.
`GeLoss` holds p, r, h, k in percent with the literature's meanings (Hasslinger & Hohlfeld):
h and k are the probabilities that a packet gets THROUGH in the bad and the good state. The
defaults h = 0, k = 100 make the simple Gilbert model: every packet in the bad state is lost,
none in the good one. `tc ... loss gemodel p r 1-h 1-k` is the same link.

`GeChain` is the app backend's copy of the kernel's chain (seeded), `expected` the figures a
measurement is judged against: the stationary loss rate and, for the simple Gilbert model, the
mean burst length 1/r.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GeChain", "GeLoss", "burst_interval", "bursts", "loss_interval"]

FIELDS = ("p", "r", "h", "k")


@dataclass(frozen=True)
class GeLoss:
    """Gilbert–Elliott loss, in percent: p good→bad, r bad→good, h / k delivered in bad / good."""

    p: float
    r: float = 100.0
    h: float = 0.0
    k: float = 100.0

    def __post_init__(self) -> None:
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 <= value <= 100
            ):
                raise ValueError(f"loss_model.{name} must be a percentage in 0..100, "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.p > 0 and self.r == 0:
            raise ValueError("loss_model.r must be > 0 when p > 0 (the bad state would never end)")

    @classmethod
    def from_json(cls, data: Any) -> GeLoss:
        if not isinstance(data, Mapping):
            raise ValueError(f"loss_model must be a mapping {{p, r, h, k}}, got {data!r}")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(f"loss_model: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(FIELDS)}")
        if "p" not in data:
            raise ValueError("loss_model.p is missing (the good→bad probability, percent)")
        return cls(**{k: data[k] for k in FIELDS if k in data})

    def to_json(self) -> dict[str, float]:
        return {"p": self.p, "r": self.r, "h": self.h, "k": self.k}

    def stationary_bad(self) -> float:
        """Share of packets sent in the bad state."""
        total = self.p + self.r
        return self.p / total if total else 0.0

    def loss_rate(self) -> float:
        """Expected share of packets lost (0..1)."""
        bad = self.stationary_bad()
        return bad * (1 - self.h / 100) + (1 - bad) * (1 - self.k / 100)

    def mean_burst(self) -> float | None:
        """Mean length of a run of lost packets, in packets, for the simple Gilbert model."""
        if self.h != 0 or self.k != 100 or self.r == 0:
            return None
        return 100.0 / self.r

    def describe(self) -> str:
        return (f"loss gemodel {self.p:g}% {self.r:g}% {100 - self.h:g}% {100 - self.k:g}%")


class GeChain:
    """The kernel's chain for one link: `lost()` per packet, in order."""

    def __init__(self, model: GeLoss, rng: random.Random) -> None:
        self.model = model
        self._rng = rng
        self.bad = False

    def lost(self) -> bool:
        m, rnd = self.model, self._rng.random
        if not self.bad:
            if rnd() < m.p / 100:
                self.bad = True
            return rnd() < 1 - m.k / 100
        if rnd() < m.r / 100:
            self.bad = False
        return rnd() > m.h / 100


def bursts(lost: Sequence[bool]) -> list[int]:
    """Lengths of the runs of consecutive losses."""
    out, run = [], 0
    for flag in lost:
        if flag:
            run += 1
        elif run:
            out.append(run)
            run = 0
    if run:
        out.append(run)
    return out


def loss_interval(model: GeLoss, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval (percent) of the loss rate over n packets of a simple Gilbert chain.

    The share of time a two-state chain spends bad has variance
    pi_b (1 - pi_b) (1 + lam) / (1 - lam) / n, lam = 1 - p - r its second eigenvalue.
    """
    rate = model.loss_rate()
    lam = 1 - model.p / 100 - model.r / 100
    var = rate * (1 - rate) * (1 + lam) / max(1e-9, 1 - lam) / max(1, n)
    half = z * math.sqrt(var)
    return max(0.0, rate - half) * 100, min(1.0, rate + half) * 100


def burst_interval(model: GeLoss, count: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% interval of the mean of `count` burst lengths (geometric, mean 1/r)."""
    mean = model.mean_burst()
    if mean is None or count == 0:
        return None
    r = model.r / 100
    half = z * math.sqrt(1 - r) / r / math.sqrt(count)
    return max(1.0, mean - half), mean + half
