"""Rows → figures: per-policy statistics, summary.json (docs/contracts.md) and honest comparisons.

Percentiles come from HDR histograms (`hdrhistogram`, 3 significant digits, 1 µs to 1 h), so
they are exact to 0.1% and never from sorting by hand; means are exact sums. Figures leave out
the warm-up requests; the token counts (`tokens` completed, `failed_tokens`) cover every token
issued, warm-up included, so completed + failed = rows of tokens.csv for that policy.

A comparison of two policies (`compare`) gives the change of the mean token latency (and of
traffic per token) with a 95% confidence interval from a bootstrap over requests (tokens of
one request are not independent, so requests are resampled whole), and a two-sided
Mann-Whitney U test on the per-request mean latency. A change whose interval holds 0 is not
called a difference, whatever the p-value says: the verdict has one rule, the CI. The report
compares policies paired by request instead
(`experiments.analysis.paired`): every policy serves the same requests, so they are resampled
together; `compare` stays for samples that are not paired.

Each policy also gets its latency split from the token rows (`emulated_ms`, `overhead_ms` and
the components, docs/measurement.md): the overhead share is the summed host overhead over the
summed measured latency of its measured tokens, nan when the rows carry no split; and, with
repetitions (`rep`), the mean and p99 token latency of each repetition and their spread.
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

from orchestrator.scenario.scenario import DEFAULT_SLO_MS  # the scenario's default, `slo_ms`
from router.records import MIX_KEYS

from ..run.rows import RequestRow, TokenRow
from ..run.runmeta import RunMeta

__all__ = [
    "DEFAULT_SLO_MS",
    "SPLIT_KEYS",
    "Comparison",
    "LatencyHist",
    "PolicyStats",
    "compare",
    "policy_stats",
    "summary_json",
]

PERCENTILES = (50.0, 95.0, 99.0)
BOOTSTRAP = 2000
_HDR_LOW_US, _HDR_HIGH_US, _HDR_DIGITS = 1, 3_600_000_000, 3
# the latency split of a token (TokenRow columns, ms): emulated components, then the host's
SPLIT_KEYS = ("link_ms", "queue_ms", "load_ms", "compute_ms", "dense_ms", "plan_ms",
              "emulated_ms", "overhead_ms", "dense_host_ms")


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
    rehomed: dict[str, int] = field(default_factory=dict)  # user's own home → requests sent away
    predicted_mean_ms: float = math.nan
    # the latency split (see the module docstring); nan where the rows carry none
    overhead_share: float = math.nan  # 0-1: host overhead / measured latency
    emulated: dict[str, float] = field(
        default_factory=lambda: {"mean": math.nan, "p99": math.nan})
    split: dict[str, float] = field(  # mean per measured token of each SPLIT_KEYS column
        default_factory=lambda: dict.fromkeys(SPLIT_KEYS, math.nan))
    split_tokens: int = 0  # measured tokens that carry the split
    loop_lag: dict[str, Any] | None = None  # worst node: {"p99", "max", ...} ms; None: absent
    scoring_failed_tokens: int = 0  # held-out positions that failed under this policy
    reps: list[dict[str, float]] = field(default_factory=list)  # per repetition, see reps_of
    failed_measured: int = 0  # tokens outside the warm-up that failed (beside measured_tokens)

    @property
    def rep_spread_pct(self) -> float:
        """(max - min) / mean of the repetitions' mean token latency, in % (nan with one)."""
        means = [r["mean"] for r in self.reps if math.isfinite(r["mean"])]
        if len(means) < 2:
            return math.nan
        return 100.0 * (max(means) - min(means)) / float(np.mean(means))

    @property
    def rep_cv_pct(self) -> float:
        """Standard deviation (n - 1) / mean of the repetitions' mean latency, in %."""
        means = [r["mean"] for r in self.reps if math.isfinite(r["mean"])]
        if len(means) < 2:
            return math.nan
        return 100.0 * float(np.std(means, ddof=1) / np.mean(means))

    def summary(self) -> dict[str, Any]:
        """This policy's entry of summary.json (docs/contracts.md), nan written as null."""
        lag = None if self.loop_lag is None else {
            "p99": _num(self.loop_lag.get("p99", math.nan)),
            "max": _num(self.loop_lag.get("max", math.nan)),
            "over_5ms_frac": _num(self.loop_lag.get("over_5ms_frac", math.nan)),
            "node": self.loop_lag.get("node")}
        return {
            "tokens": self.tokens, "failed_tokens": self.failed_tokens,
            "measured_tokens": self.measured_tokens,
            "failed_measured_tokens": self.failed_measured,
            "rerouted_tokens": self.rerouted_tokens,
            "latency_ms": _clean(self.latency), "ttft_ms": _clean(self.ttft),
            "throughput_tok_s": _num(self.throughput_tok_s),
            "slo_share": _num(self.slo_share),
            "traffic_bytes": self.traffic_bytes,
            "quality_delta_pct": _num(self.quality_delta_pct),
            "mix": {k: _num(self.mix[k]) for k in MIX_KEYS},
            "overhead_share": (None if not math.isfinite(self.overhead_share)
                               else round(float(self.overhead_share), 6)),
            "emulated_ms": _clean(self.emulated),
            "latency_split_ms": {k.removesuffix("_ms"): _num(v) for k, v in self.split.items()},
            "loop_lag_ms": lag,
            "scoring_failed_tokens": int(self.scoring_failed_tokens),
            "repeats": {"mean_ms": [_num(r["mean"]) for r in self.reps],
                        "p99_ms": [_num(r["p99"]) for r in self.reps],
                        "spread_pct": _num(self.rep_spread_pct),
                        "cv_pct": _num(self.rep_cv_pct)},
        }


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


def _clean(d: Mapping[str, float]) -> dict[str, float | None]:
    return {k: _num(v) for k, v in d.items()}


def _split_of(done: Sequence[TokenRow]) -> tuple[float, dict[str, float], dict[str, float],
                                                  int]:
    """(overhead share, emulated {"mean","p99"}, mean of each split column, tokens with it)."""
    nan = math.nan
    with_split = [t for t in done if math.isfinite(t.overhead_ms) and
                  math.isfinite(t.latency_ms)]
    total = sum(t.latency_ms for t in with_split)
    share = (sum(t.overhead_ms for t in with_split) / total) if with_split and total > 0 \
        else nan
    emu = LatencyHist.of(t.emulated_ms for t in with_split)
    split = {}
    for k in SPLIT_KEYS:
        vals = [v for v in (float(getattr(t, k, nan)) for t in with_split) if math.isfinite(v)]
        split[k] = float(np.mean(vals)) if vals else nan
    return share, {"mean": emu.mean(), "p99": emu.pct(99.0)}, split, len(with_split)


def reps_of(done: Sequence[TokenRow]) -> list[dict[str, float]]:
    """Per repetition (in `rep` order): {"rep", "mean", "p99", "tokens"} of the measured
    tokens' latency."""
    by: dict[int, list[float]] = defaultdict(list)
    for t in done:
        by[t.rep].append(t.latency_ms)
    out = []
    for rep in sorted(by):
        h = LatencyHist.of(by[rep])
        out.append({"rep": rep, "mean": h.mean(), "p99": h.pct(99.0), "tokens": h.count})
    return out


def policy_stats(
    name: str,
    tokens: Sequence[TokenRow],
    requests: Sequence[RequestRow],
    *,
    warmup_s: float = 0.0,
    slo_ms: float = DEFAULT_SLO_MS,
    quality_delta_pct: float = math.nan,
    quality_source: str = "none",
    loop_lag: dict[str, Any] | None = None,
    scoring_failed_tokens: int = 0,
) -> PolicyStats:
    """Figures of one policy from its rows (rows of other policies must be filtered out).

    With repetitions the rows of every repetition count together; the throughput is per
    repetition (every repetition's workload spans the same scenario window), and the SLO
    share counts each repetition's request on its own."""
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
    per_req: dict[tuple[int, int], list[float]] = defaultdict(list)
    for t in done:
        per_req[(t.rep, t.request)].append(t.latency_ms)
    within = sum(1 for r in reqs if r.ok and per_req.get((r.rep, r.request))
                 and float(np.mean(per_req[(r.rep, r.request)])) <= slo_ms)
    n_reps = max(len({t.rep for t in done}), 1)
    reasons = Counter(t.reason for t in tokens if not t.ok)
    traffic = sum(t.bytes for t in done)
    ok_all = [t for t in tokens if t.ok]
    share, emulated, split, split_tokens = _split_of(done)
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
        throughput_tok_s=len(done) / window / n_reps if done else 0.0,
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
        rehomed=dict(Counter(r.rehomed_from for r in requests if r.rehomed_from)),
        predicted_mean_ms=float(np.mean([t.predicted_ms for t in done])) if done else math.nan,
        overhead_share=share, emulated=emulated, split=split, split_tokens=split_tokens,
        loop_lag=loop_lag, scoring_failed_tokens=scoring_failed_tokens, reps=reps_of(done),
        failed_measured=len(measured) - len(done),
    )


def summary_json(meta: RunMeta, stats: Sequence[PolicyStats], *,
                 comparisons: Sequence[Comparison] = (),
                 faithful: tuple[bool, Sequence[str]] | None = None,
                 quality: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """summary.json as docs/contracts.md (times in scenario time), with the faithfulness verdict
    (`faithful`, `unfaithful_reasons`: `experiments.analysis.faithful`, judged here when not given)
    and the paired `comparisons` the report's table shows."""
    if faithful is None:
        from .faithful import assess

        faithful = assess(meta, stats)
    ok, reasons = faithful
    out = {
        "scenario": meta.scenario, "runtime": meta.runtime, "shaper": meta.shaper,
        "model": meta.model, "seed": meta.seed, "time_dilation": meta.time_dilation,
        "clock": meta.clock, "virtual_speedup": meta.virtual_speedup,
        "faithful": bool(ok), "unfaithful_reasons": [str(r) for r in reasons],
        "repeat": int(meta.repeats.get("n", 1)),
        "policies": {s.name: s.summary() for s in stats},
        "comparisons": [c.summary_entry() for c in comparisons],
    }
    if quality is not None:
        out["quality"] = dict(quality)
    return out


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
    # resampled by request on both sides together (experiments.analysis.paired)
    paired: bool = False
    mean_diff: float = math.nan  # paired: mean over requests of (b - a) of the request's mean

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

    def summary_entry(self) -> dict[str, Any]:
        """This comparison as an entry of summary.json's `comparisons`."""
        return {"policy": self.b, "against": self.a, "metric": self.metric,
                "value": _num(self.value_b), "against_value": _num(self.value_a),
                "change_pct": _num(self.change_pct),
                "paired_ci_pct" if self.paired else "ci95_pct":
                    [_num(self.ci_low_pct), _num(self.ci_high_pct)],
                "p_value": _num(self.p_value), "significant": self.significant,
                "requests": self.n_a if self.paired else [self.n_a, self.n_b],
                "mean_diff": _num(self.mean_diff), "verdict": self.verdict(),
                "verdict_rule": "ci95"}  # the verdict is the CI's, whatever p says


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
