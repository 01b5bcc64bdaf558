"""Each policy's own 95% intervals, for the error bars of `bars.png` (experiments.report.plots).

The unit of resampling is the request, as in the paired comparisons (experiments.analysis.paired): a
request's tokens share a prompt, a home and a moment of load, so they are not independent.
Each resample draws the policy's requests with replacement and recomputes the figure over
the drawn requests' completed measured tokens (the per-policy tables' figures: mean and p99
token latency, bytes per 1,000 tokens). The generator is seeded with the run's seed, so a
redrawn report gives the same bars. Throughput is one window's count: it gets no interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..run.rows import TokenRow
from .paired import per_request

__all__ = ["RESAMPLES", "policy_intervals"]

RESAMPLES = 1000


def _interval(groups: list[np.ndarray], figure: str, rng: np.random.Generator
              ) -> tuple[float, float]:
    if len(groups) < 2:
        return (math.nan, math.nan)
    sums = np.array([g.sum() for g in groups])
    counts = np.array([len(g) for g in groups])
    draws = rng.integers(0, len(groups), size=(RESAMPLES, len(groups)))
    if figure == "mean":
        values = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    else:  # p99 of the drawn requests' pooled tokens
        values = np.array([np.percentile(np.concatenate([groups[i] for i in row]), 99.0)
                           for row in draws])
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def policy_intervals(tokens: Mapping[str, Sequence[TokenRow]], seed: int
                     ) -> dict[str, dict[str, tuple[float, float]]]:
    """policy → {"mean", "p99" (token latency ms), "traffic_per_1k" (MB)} → (low, high)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for i, (name, rows) in enumerate(tokens.items()):
        rng = np.random.default_rng([seed, i])
        lat = [np.asarray(v) for _, v in sorted(per_request(rows).values.items()) if v]
        traffic = [np.asarray(v) for _, v in sorted(per_request(rows, "bytes").values.items())
                   if v]
        t_lo, t_hi = _interval(traffic, "mean", rng)
        out[name] = {"mean": _interval(lat, "mean", rng), "p99": _interval(lat, "p99", rng),
                     "traffic_per_1k": (t_lo * 1e3 / 1e6, t_hi * 1e3 / 1e6)}
    return out
