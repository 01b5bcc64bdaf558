"""Comparisons paired by request: every policy serves the same seeded requests (same ids).

A policy's request `i` and another policy's request `i` are the same prompt, the same
generation length, the same home node and the same arrival time, so the two are compared
request by request: the units of the bootstrap are the requests both policies completed
(at least one measured token each), resampled with the SAME draw on both sides. What varies
from request to request (a long prompt, a home far from the experts it needs) then cancels
out of the difference, and the interval is about the policies, not about the workload.

Metrics (the name is what `summary.json`'s `comparisons` say):

* `mean_latency`: mean token latency over the paired requests' measured tokens (every token
  weighs the same, as in the per-policy tables): the ratio of the summed latencies over the
  summed token counts, for each side of each resample;
* `p99_latency`: the 99th percentile of the paired requests' token latencies (the rank the
  HDR histograms of the tables use, on exact values);
* `traffic`: bytes moved per measured token, like `mean_latency`;
* `ttft`: the first generated token's latency (index 0 in tokens.csv: the prompt's prefill
  and the first decode step), mean over the paired requests;
* `decode_latency`: mean latency of the other tokens (index >= 1: decode steps only), like
  `mean_latency` on those tokens. The overall mean mixes the two; a policy can win on
  prefill and not on decode (issue 39 saw exactly that), so both are compared apart.

Failed tokens are not dropped from the latency metrics, or a policy that fails its slow
tokens would look faster than one that completes them: a measured token that failed counts
at `failed_at` ms, the slowest measured token latency any policy of the run completed
(`failed_charge`): as slow as the slowest completion, so failing can never be cheaper than
completing, and the comparison stays on the same scale (a 10 s client deadline would swamp
every mean). A request is then paired when both policies were asked for measured tokens in
it, completed or not. Traffic stays per completed token (a failed token moved no answer).

The change is `100 x (b / a - 1)` in percent; its 95% CI is the percentile interval of that
change over `BOOTSTRAP` paired resamples from a generator seeded with the run's seed, so a
report redrawn from the same rows gives the same interval. With repetitions
(`moemesh run --repeat N`) a request's tokens of every repetition are pooled into that
request: the unit stays the request, and the run-to-run noise is inside each unit's value.
The p-value (mean metrics) is a two-sided Wilcoxon signed-rank test on the per-request
differences of the request's mean; `p99_latency` gets none. The two can disagree (the test is
about the median per-request difference, the CI about the change of the token-weighted mean):
the verdict is the CI's alone (`Comparison.verdict`), and the report says so.

`paired_changes` gives the bootstrap replicates themselves (the same draw as
`paired_compare`'s): `experiments.study.run` resamples requests inside each world with it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import wilcoxon

from ..run.rows import TokenRow
from .metrics import BOOTSTRAP, Comparison

__all__ = ["METRICS", "PerRequest", "failed_charge", "paired_changes", "paired_compare",
           "per_request"]

METRICS = {"mean_latency": "latency_ms", "p99_latency": "latency_ms", "traffic": "bytes",
           "ttft": "latency_ms", "decode_latency": "latency_ms"}
# which tokens of a request a metric reads (by `index`; None: every token)
TOKENS: dict[str, tuple[int, int | None] | None] = {"ttft": (0, 1), "decode_latency": (1, None)}
P99 = 99.0
_CHUNK = 250  # resamples per block in the percentile bootstrap (bounds the memory)


@dataclass(frozen=True)
class PerRequest:
    """One policy's measured tokens grouped by request: id → the values of its tokens."""

    values: dict[int, list[float]]

    def ids(self) -> set[int]:
        return set(self.values)


def per_request(tokens: Sequence[TokenRow], attr: str = "latency_ms",
                failed_at: float | None = None,
                index: tuple[int, int | None] | None = None) -> PerRequest:
    """The completed, measured (outside the warm-up) tokens' `attr`, by request id; every
    repetition of a request is pooled into it. With `failed_at`, a measured token that failed
    counts at that value (see the module docstring); with `index` = (lo, hi), only the tokens
    whose position in their request is in lo..hi-1 (hi None: no end) count."""
    out: dict[int, list[float]] = defaultdict(list)
    lo, hi = index if index is not None else (0, None)
    for t in tokens:
        if t.warmup or t.index < lo or (hi is not None and t.index >= hi):
            continue
        if not t.ok:
            if failed_at is not None:
                out[t.request].append(failed_at)
            continue
        v = float(getattr(t, attr))
        if math.isfinite(v):
            out[t.request].append(v)
    return PerRequest(dict(out))


def failed_charge(*policies: Sequence[TokenRow]) -> float:
    """What a failed measured token counts as in latency comparisons: the slowest measured
    token latency that any of `policies` completed (nan when none completed one)."""
    worst = [t.latency_ms for rows in policies for t in rows
             if t.ok and not t.warmup and math.isfinite(t.latency_ms)]
    return max(worst) if worst else math.nan


def _nearest_rank(sorted_values: np.ndarray, weights: np.ndarray, p: float) -> np.ndarray:
    """The p-th percentile of `sorted_values` under each row of `weights` (resample counts
    per value, shape (B, T)); one value per row. The rank is HDR histogram's (round(p% x n),
    at least 1), so the point estimate agrees with the per-policy tables."""
    cum = np.cumsum(weights, axis=1)
    rank = np.maximum(np.floor(p / 100.0 * cum[:, -1] + 0.5), 1)
    pos = (cum < rank[:, None]).sum(axis=1)
    return sorted_values[np.minimum(pos, len(sorted_values) - 1)]


def _percentile_boot(a: list[np.ndarray], b: list[np.ndarray], idx: np.ndarray,
                     p: float) -> tuple[np.ndarray, np.ndarray]:
    out_a, out_b = [], []
    for side, out in ((a, out_a), (b, out_b)):
        values = np.concatenate(side)
        owner = np.concatenate([np.full(len(v), i) for i, v in enumerate(side)])
        order = np.argsort(values, kind="stable")
        values, owner = values[order], owner[order]
        n = len(side)
        for lo in range(0, len(idx), _CHUNK):
            block = idx[lo:lo + _CHUNK]
            counts = np.zeros((len(block), n), dtype=np.int32)
            np.add.at(counts, (np.arange(len(block))[:, None], block), 1)
            out.append(_nearest_rank(values, counts[:, owner], p))
    return np.concatenate(out_a), np.concatenate(out_b)


def _paired_values(a: Sequence[TokenRow], b: Sequence[TokenRow], metric: str,
                   failed_at: float | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per paired request (ids both sides have, in id order), each side's values."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    attr = METRICS[metric]
    charge = (failed_at if attr == "latency_ms" and failed_at is not None
              and math.isfinite(failed_at) else None)
    which = TOKENS.get(metric)
    pa, pb = per_request(a, attr, charge, which), per_request(b, attr, charge, which)
    keys = sorted(pa.ids() & pb.ids())
    return ([np.asarray(pa.values[k], dtype=float) for k in keys],
            [np.asarray(pb.values[k], dtype=float) for k in keys])


def _point(values: list[np.ndarray], metric: str) -> float:
    if metric == "p99_latency":
        flat = np.sort(np.concatenate(values))
        return float(_nearest_rank(flat, np.ones((1, len(flat))), P99)[0])
    return float(sum(v.sum() for v in values) / sum(len(v) for v in values))


def _boot_changes(va: list[np.ndarray], vb: list[np.ndarray], metric: str,
                  idx: np.ndarray) -> np.ndarray:
    """The change in % of b against a under each row of request indices `idx` (B, n); the
    non-finite ones dropped."""
    if metric == "p99_latency":
        boot_a, boot_b = _percentile_boot(va, vb, idx, P99)
    else:
        sa, ca = np.array([v.sum() for v in va]), np.array([len(v) for v in va], dtype=float)
        sb, cb = np.array([v.sum() for v in vb]), np.array([len(v) for v in vb], dtype=float)
        boot_a = sa[idx].sum(axis=1) / ca[idx].sum(axis=1)
        boot_b = sb[idx].sum(axis=1) / cb[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        changes = 100.0 * (boot_b / boot_a - 1.0)
    return changes[np.isfinite(changes)]


def _draw(seed: int, n: int, resamples: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0xB007])
    return rng.integers(0, n, size=(resamples, n))


def paired_changes(a: Sequence[TokenRow], b: Sequence[TokenRow], metric: str = "mean_latency",
                   *, seed: int = 0, resamples: int = BOOTSTRAP,
                   failed_at: float | None = None) -> tuple[float, np.ndarray, int]:
    """(change in %, its bootstrap replicates, paired requests) of b against a: the same
    numbers `paired_compare` summarises (same draw for the same seed). Fewer than two paired
    requests: no replicates (an empty array)."""
    va, vb = _paired_values(a, b, metric, failed_at)
    if not va:
        return math.nan, np.empty(0), 0
    ma, mb = _point(va, metric), _point(vb, metric)
    change = 100.0 * (mb / ma - 1.0) if ma else math.nan
    if len(va) < 2:
        return change, np.empty(0), len(va)
    return change, _boot_changes(va, vb, metric, _draw(seed, len(va), resamples)), len(va)


def paired_compare(a_name: str, a: Sequence[TokenRow], b_name: str, b: Sequence[TokenRow],
                   metric: str = "mean_latency", *, seed: int = 0,
                   resamples: int = BOOTSTRAP, failed_at: float | None = None) -> Comparison:
    """`b` against `a` on `metric` (see the module docstring), paired by request id; with
    `failed_at` (latency metrics only) a failed measured token counts at that many ms."""
    va, vb = _paired_values(a, b, metric, failed_at)
    nan = math.nan
    if not va:
        return Comparison(metric, a_name, b_name, nan, nan, nan, nan, nan, nan, 0, 0,
                          paired=True)
    ma, mb = _point(va, metric), _point(vb, metric)
    change = 100.0 * (mb / ma - 1.0) if ma else nan
    means_a = np.array([v.mean() for v in va])
    means_b = np.array([v.mean() for v in vb])
    diff = float(np.mean(means_b - means_a))
    n = len(va)
    if n < 2:
        return Comparison(metric, a_name, b_name, ma, mb, change, nan, nan, nan, 1, 1,
                          paired=True, mean_diff=diff)
    changes = _boot_changes(va, vb, metric, _draw(seed, n, resamples))
    lo, hi = (np.percentile(changes, [2.5, 97.5]) if len(changes) else (nan, nan))
    p = nan
    if metric != "p99_latency":
        d = means_b - means_a
        if not np.any(d):
            p = 1.0
        else:
            try:
                p = float(wilcoxon(d).pvalue)
            except ValueError:
                p = nan
    return Comparison(metric, a_name, b_name, ma, mb, float(change), float(lo), float(hi), p,
                      n, n, paired=True, mean_diff=diff)
