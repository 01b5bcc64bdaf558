"""netem's delay distributions and correlated random numbers, for both backends.

The kernel draws a jittered delay as `mu + sigma * table[rnd % size] / 8192` (sch_netem.c,
`tabledist`), where the table is the inverse CDF of a distribution with mean ~0 and standard
deviation ~1, sampled at 4,096 points and scaled by NETEM_DIST_SCALE = 8192. Without a table the
draw is uniform in [mu - sigma, mu + sigma). `rnd` is a 32-bit random number, correlated with the
previous one when a correlation rho is set: `next = (v * (2^32 - rho') + last * rho') >> 32`
with `rho' = rho + 1` and rho = pct / 100 * (2^32 - 1) (`get_crandom`). Note what that rule
does: the correlated number is reduced modulo the table size (or 2 sigma in ns), which spreads
neighbouring numbers apart again, so successive DELAYS are only weakly correlated even at a high
`jitter_corr_pct` (a known property of netem; both backends keep it rather than "fix" it).

The tables are made here exactly as iproute2 makes the files it ships in
/usr/lib/x86_64-linux-gnu/tc/*.dist (its netem/normal.c, pareto.c, paretonormal.c);
tests/netem/test_dist.py checks them against those files where iproute2 is installed. The tc
backend sends them to the kernel (TCA_NETEM_DELAY_DIST); the app backend draws from the same
tables with the same rule, so a seeded link means the same in both.

The "uniform" table is ours: the kernel keeps a leaf's table until another one is sent, so a
leaf going back from normal to uniform gets a linear table (uniform in [-1, 1) in 4,096 steps)
instead of none.
"""

from __future__ import annotations

import math
import random
import statistics
from functools import cache, lru_cache

__all__ = [
    "DISTRIBUTIONS", "SCALE", "CorrelatedRandom", "draw_delay_ms", "moments", "percent_u32",
    "table",
]

DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
SCALE = 8192  # NETEM_DIST_SCALE
_FINE = 16384  # iproute2's TABLESIZE; every 4th point is kept: 4,096 entries
_PARETO_A = 3.0
U32 = 1 << 32


def _clamp16(value: int) -> int:
    return max(-32768, min(32767, value))


@lru_cache(maxsize=1)
def _normal_fine() -> tuple[float, ...]:
    """x at each 1/16384 step of the standard normal CDF, found by a fine scan as iproute2 does."""
    fine = [0.0] * (_FINE + 1)
    steps = round((10.05 + 10.0) / 0.00005) + 1
    x = -10.0
    for _ in range(steps):
        if x >= 10.05:
            break
        fine[round(_FINE * (0.5 + 0.5 * math.erf(x / math.sqrt(2.0))))] = x
        x += 0.00005
    return tuple(fine)


def _pareto_value(i: int) -> int:
    """Pareto (a = 3) inverse CDF at i / 65536, shifted to mean 0, clipped at 4 sigma-units."""
    value = (1.0 / (i / 65536) ** (1.0 / _PARETO_A) - 1.5) * (4.0 / 3.0) * SCALE
    return round(min(value, 32767))


@cache
def table(name: str) -> tuple[int, ...]:
    """The 4,096-entry table of a distribution (values in 1/8192 of sigma)."""
    if name == "normal":
        fine = _normal_fine()
        return tuple(_clamp16(round(fine[i] * SCALE)) for i in range(0, _FINE, 4))
    if name == "pareto":
        return tuple(_pareto_value(i) for i in range(65536, 0, -16))
    if name == "paretonormal":
        fine = _normal_fine()
        return tuple(int((round(fine[i] * SCALE) + 3 * _pareto_value(65536 - 4 * i)) / 4)
                     for i in range(0, _FINE, 4))
    if name == "uniform":
        return tuple(-SCALE + i * 2 * SCALE // 4096 for i in range(4096))
    raise ValueError(f"unknown jitter distribution {name!r}; known: {', '.join(DISTRIBUTIONS)}")


def moments(name: str, delay_ms: float, jitter_ms: float) -> tuple[float, float]:
    """Mean and standard deviation (ms) of netem's delay for this distribution, from its table
    (for uniform, of the kernel's own draw: a half-width of jitter_ms)."""
    if jitter_ms == 0:
        return delay_ms, 0.0
    if name == "uniform":
        return delay_ms, jitter_ms / math.sqrt(3.0)
    values = table(name)
    return (delay_ms + jitter_ms * statistics.fmean(values) / SCALE,
            jitter_ms * statistics.pstdev(values) / SCALE)


def percent_u32(pct: float) -> int:
    """A percentage as netlink carries it: pct / 100 of 2^32 - 1 (iproute2's get_percent)."""
    return min(U32 - 1, max(0, round(pct / 100.0 * (U32 - 1))))


class CorrelatedRandom:
    """netem's `get_crandom`: 32-bit random numbers, each leaning rho on the previous one."""

    def __init__(self, rng: random.Random, corr_pct: float = 0.0) -> None:
        self._rng = rng
        self.rho = percent_u32(corr_pct)
        self.last = rng.getrandbits(32)

    def next(self) -> int:
        value = self._rng.getrandbits(32)
        if self.rho == 0:
            return value
        rho = self.rho + 1
        self.last = (value * (U32 - rho) + self.last * rho) >> 32
        return self.last


def draw_delay_ms(delay_ms: float, jitter_ms: float, dist: str, rnd: int) -> float:
    """One delay as the kernel's `tabledist` computes it (in ms instead of ns), never below 0."""
    if jitter_ms == 0:
        return delay_ms
    if dist == "uniform":  # the kernel's draw without a table, in whole nanoseconds
        sigma_ns = max(1, round(jitter_ms * 1e6))
        return max(0.0, delay_ms + ((rnd % (2 * sigma_ns)) - sigma_ns) / 1e6)
    values = table(dist)
    return max(0.0, delay_ms + jitter_ms * values[rnd % len(values)] / SCALE)
