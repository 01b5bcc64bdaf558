"""Rows → figures: per-policy statistics, summary.json (DESIGN §3) and honest comparisons.

Percentiles come from HDR histograms (`hdrhistogram`, 3 significant digits, 1 µs to 1 h), so
they are exact to 0.1% and never from sorting by hand; means are exact sums. Figures leave out
the warm-up requests; the token counts (`tokens` completed, `failed_tokens`) cover every token
issued, warm-up included, so completed + failed = rows of tokens.csv for that policy.

A comparison of two policies (`compare`) gives the change of the mean token latency (and of
traffic per token) with a 95% confidence interval from a bootstrap over requests (tokens of
one request are not independent, so requests are resampled whole), and a two-sided
Mann-Whitney U test on the per-request mean latency. A change whose interval holds 0 is not
called a difference.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram
from scipy.stats import mannwhitneyu

from router.records import MIX_KEYS

from .rows import RequestRow, TokenRow

__all__ = [
    "DEFAULT_SLO_MS",
    "Comparison",
    "LatencyHist",
    "PolicyStats",
    "compare",
    "policy_stats",
    "summary_json",
]

DEFAULT_SLO_MS = 300.0  # HetRoute's SLO: a request's mean token latency within 300 ms
PERCENTILES = (50.0, 95.0, 99.0)
BOOTSTRAP = 2000
_HDR_LOW_US, _HDR_HIGH_US, _HDR_DIGITS = 1, 3_600_000_000, 3


class LatencyHist:
    """Milliseconds into an HDR histogram (µs resolution); exact mean beside it."""

    def __init__(self) -> None:
        self.h = HdrHistogram(_HDR_LOW_US, _HDR_HIGH_US, _HDR_DIGITS)
        self.total = 0.0
        self.count = 0

    def add(self, ms: float) -> None:
        if not math.isfinite(ms):
            return
        us = min(max(round(ms * 1000.0), _HDR_LOW_US), _HDR_HIGH_US)
        self.h.record_value(us)
        self.total += ms
        self.count += 1

    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def pct(self, p: float) -> float:
        return self.h.get_value_at_percentile(p) / 1000.0 if self.count else math.nan

    def summary(self) -> dict[str, float]:
        """{"mean", "p50", "p95", "p99"} in ms (nan without samples)."""
        out = {"mean": self.mean()}
        for p in PERCENTILES:
            out[f"p{p:g}"] = self.pct(p)
        return out

    @classmethod
    def of(cls, values: Iterable[float]) -> LatencyHist:
        h = cls()
        for v in values:
            h.add(v)
        return h


@dataclass
class PolicyStats:
    """Every figure of one policy (arm) of a run; see the module docstring for what counts."""

    name: str
    issued: int
    tokens: int  # completed, warm-up included
    failed_tokens: int
    rerouted_tokens: int
    measured_tokens: int  # completed outside the warm-up: what the figures use
    latency: dict[str, float]
    ttft: dict[str, float]
    request_latency: dict[str, float]
    throughput_tok_s: float
    window_s: float
    slo_share: float  # requests (outside warm-up) whose every token ran and mean ≤ SLO
    requests: int
    failed_requests: int
    traffic_bytes: int
    traffic_per_1k: float  # bytes per 1,000 measured tokens
    mix: dict[str, float]  # shares of expert executions (sum 1)
    mix_counts: dict[str, int]
    quantized_share: float
    local_share: float  # expert executions on the home node (exact or substitute)
    quality_delta_pct: float
    quality_source: str
    reasons: dict[str, int] = field(default_factory=dict)
    predicted_mean_ms: float = math.nan

    def summary(self) -> dict[str, Any]:
        """This policy's entry of summary.json (DESIGN §3), nan written as null."""
        return {
            "tokens": self.tokens, "failed_tokens": self.failed_tokens,
            "rerouted_tokens": self.rerouted_tokens,
            "latency_ms": _clean(self.latency), "ttft_ms": _clean(self.ttft),
            "throughput_tok_s": _num(self.throughput_tok_s),
            "traffic_bytes": self.traffic_bytes,
            "quality_delta_pct": _num(self.quality_delta_pct),
            "mix": {k: _num(self.mix[k]) for k in MIX_KEYS},
        }


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


def _clean(d: Mapping[str, float]) -> dict[str, float | None]:
    return {k: _num(v) for k, v in d.items()}


def policy_stats(
    name: str,
    tokens: Sequence[TokenRow],
    requests: Sequence[RequestRow],
    *,
    warmup_s: float = 0.0,
    slo_ms: float = DEFAULT_SLO_MS,
    quality_delta_pct: float = math.nan,
    quality_source: str = "none",
) -> PolicyStats:
    """Figures of one policy from its rows (rows of other policies must be filtered out)."""
    measured = [t for t in tokens if not t.warmup]
    done = [t for t in measured if t.ok]
    lat = LatencyHist.of(t.latency_ms for t in done)
    ttft = LatencyHist.of(r.ttft_ms for r in requests if not r.warmup)
    reqs = [r for r in requests if not r.warmup]
    req_lat = LatencyHist.of(r.latency_ms for r in reqs if r.ok)
    start = warmup_s
    end = max((t.done_s for t in done if math.isfinite(t.done_s)), default=start)
    window = max(end - start, 1e-9)
    counts = Counter()
    for t in done:
        counts.update(t.mix())
    total = sum(counts.values())
    per_req: dict[int, list[float]] = defaultdict(list)
    for t in done:
        per_req[t.request].append(t.latency_ms)
    within = sum(1 for r in reqs if r.ok and per_req.get(r.request)
                 and float(np.mean(per_req[r.request])) <= slo_ms)
    reasons = Counter(t.reason for t in tokens if not t.ok)
    traffic = sum(t.bytes for t in done)
    ok_all = [t for t in tokens if t.ok]
    return PolicyStats(
        name=name,
        issued=len(tokens),
        tokens=len(ok_all),
        failed_tokens=len(tokens) - len(ok_all),
        rerouted_tokens=sum(1 for t in tokens if t.reroutes > 0),
        measured_tokens=len(done),
        latency=lat.summary(),
        ttft=ttft.summary(),
        request_latency=req_lat.summary(),
        throughput_tok_s=len(done) / window if done else 0.0,
        window_s=window,
        slo_share=within / len(reqs) if reqs else math.nan,
        requests=len(requests),
        failed_requests=sum(1 for r in requests if not r.ok),
        traffic_bytes=traffic,
        traffic_per_1k=1000.0 * traffic / len(done) if done else math.nan,
        mix={k: (counts[k] / total if total else 0.0) for k in MIX_KEYS},
        mix_counts={k: counts[k] for k in MIX_KEYS},
        quantized_share=(sum(t.quantized for t in done) / total) if total else 0.0,
        local_share=(sum(t.local for t in done) / total) if total else 0.0,
        quality_delta_pct=quality_delta_pct,
        quality_source=quality_source,
        reasons=dict(reasons),
        predicted_mean_ms=float(np.mean([t.predicted_ms for t in done])) if done else math.nan,
    )


def summary_json(meta: Mapping[str, Any], stats: Sequence[PolicyStats]) -> dict[str, Any]:
    """summary.json exactly as DESIGN §3 (times in scenario time)."""
    return {
        "scenario": str(meta["scenario"]), "runtime": str(meta["runtime"]),
        "shaper": str(meta["shaper"]), "model": str(meta["model"]), "seed": int(meta["seed"]),
        "time_dilation": float(meta["time_dilation"]),
        "policies": {s.name: s.summary() for s in stats},
    }


# ----------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Comparison:
    """`b` against `a` on one metric: change in percent, its 95% CI, and a p-value."""

    metric: str
    a: str
    b: str
    value_a: float
    value_b: float
    change_pct: float
    ci_low_pct: float
    ci_high_pct: float
    p_value: float
    n_a: int
    n_b: int

    @property
    def significant(self) -> bool:
        """The interval excludes no change (and there were samples)."""
        return math.isfinite(self.ci_low_pct) and (self.ci_low_pct > 0 or self.ci_high_pct < 0)

    def verdict(self) -> str:
        if not math.isfinite(self.change_pct):
            return "n/a"
        if not self.significant:
            return "no significant difference"
        return "lower" if self.change_pct < 0 else "higher"

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "a": self.a, "b": self.b, "value_a": _num(self.value_a),
                "value_b": _num(self.value_b), "change_pct": _num(self.change_pct),
                "ci95_pct": [_num(self.ci_low_pct), _num(self.ci_high_pct)],
                "p_value": _num(self.p_value), "significant": self.significant}


def _per_request(tokens: Sequence[TokenRow], attr: str) -> tuple[np.ndarray, np.ndarray]:
    sums: dict[int, float] = defaultdict(float)
    counts: dict[int, int] = defaultdict(int)
    for t in tokens:
        if t.ok and not t.warmup:
            sums[t.request] += float(getattr(t, attr))
            counts[t.request] += 1
    keys = sorted(sums)
    return (np.array([sums[k] for k in keys], dtype=float),
            np.array([counts[k] for k in keys], dtype=float))


def compare(a_name: str, a: Sequence[TokenRow], b_name: str, b: Sequence[TokenRow],
            metric: str = "latency_ms", seed: int = 0) -> Comparison:
    """Mean per token of `metric` ("latency_ms" or "bytes") of b against a (see the module
    docstring). Change = 100 x (mean_b / mean_a - 1)."""
    sa, ca = _per_request(a, metric)
    sb, cb = _per_request(b, metric)
    nan = math.nan
    if len(sa) < 2 or len(sb) < 2 or ca.sum() == 0 or cb.sum() == 0:
        ma = sa.sum() / ca.sum() if ca.sum() else nan
        mb = sb.sum() / cb.sum() if cb.sum() else nan
        change = 100.0 * (mb / ma - 1.0) if ma and math.isfinite(ma) and math.isfinite(mb) \
            else nan
        return Comparison(metric, a_name, b_name, ma, mb, change, nan, nan, nan,
                          len(sa), len(sb))
    ma, mb = sa.sum() / ca.sum(), sb.sum() / cb.sum()
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(sa), size=(BOOTSTRAP, len(sa)))
    ib = rng.integers(0, len(sb), size=(BOOTSTRAP, len(sb)))
    boot_a = sa[ia].sum(axis=1) / np.maximum(ca[ia].sum(axis=1), 1)
    boot_b = sb[ib].sum(axis=1) / np.maximum(cb[ib].sum(axis=1), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = 100.0 * (boot_b / boot_a - 1.0)
    ratios = ratios[np.isfinite(ratios)]
    lo, hi = (np.percentile(ratios, [2.5, 97.5]) if len(ratios) else (nan, nan))
    change = 100.0 * (mb / ma - 1.0) if ma else nan
    try:
        p = float(mannwhitneyu(sa / ca, sb / cb, alternative="two-sided").pvalue)
    except ValueError:  # all values equal
        p = 1.0
    return Comparison(metric, a_name, b_name, float(ma), float(mb), float(change), float(lo),
                      float(hi), p, len(sa), len(sb))
