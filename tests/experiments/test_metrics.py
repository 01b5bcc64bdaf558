"""Figures from rows: HDR percentiles, the token accounting, summary.json, comparisons."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from experiments.analysis.metrics import LatencyHist, compare, policy_stats, summary_json
from experiments.run.rows import RequestRow, TokenRow, read_rows, write_rows
from tests.experiments.conftest import make_rows, meta_of, token

POLICY_KEYS = {"tokens", "failed_tokens", "rerouted_tokens", "latency_ms", "ttft_ms",
               "throughput_tok_s", "traffic_bytes", "quality_delta_pct", "mix",
               # the latency split, loop lag, scoring failures, repetitions (issue 11)
               "overhead_share", "emulated_ms", "latency_split_ms", "loop_lag_ms",
               "scoring_failed_tokens", "repeats",
               "slo_share",  # requests within the SLO (issue 13: capacity mode)
               "measured_tokens", "failed_measured_tokens"}  # beside the latency (issue 26)


def test_hdr_percentiles_match_the_data_within_its_precision() -> None:
    values = np.random.default_rng(1).lognormal(3.0, 1.0, 20_000)  # ms, long tail
    h = LatencyHist.of(values)
    for p in (50, 95, 99):
        want = float(np.percentile(values, p))
        assert h.pct(p) == pytest.approx(want, rel=0.003), p  # 3 digits + the rank's step
    assert h.mean() == pytest.approx(float(values.mean()), rel=1e-9)  # exact, not bucketed
    assert math.isnan(LatencyHist().pct(50)) and math.isnan(LatencyHist().mean())


def test_every_token_is_accounted_for_and_warmup_is_left_out_of_figures() -> None:
    tokens, requests = make_rows("p", 20.0, n_requests=30, gen=8, warmup_requests=5,
                                 fail_request=12)
    s = policy_stats("p", tokens, requests, warmup_s=2.0)
    assert s.issued == len(tokens) == 30 * 8
    assert s.tokens + s.failed_tokens == s.issued
    assert s.failed_tokens == 4 and s.reasons == {"link_down": 1, "after:link_down": 3}
    assert s.measured_tokens == 25 * 8 - 4  # warm-up requests out, failed out
    measured = [t.latency_ms for t in tokens if t.ok and not t.warmup]
    assert s.latency["mean"] == pytest.approx(float(np.mean(measured)))
    assert s.failed_requests == 1 and s.requests == 30
    assert s.mix == pytest.approx({"local_exact": 0.5, "remote_exact": 0.25,
                                   "cpu_loaded": 0.125, "substitute": 0.125, "fallback": 0.0})
    assert s.traffic_per_1k == pytest.approx(1000 * 1000.0)
    assert 0 < s.slo_share <= 1 and s.throughput_tok_s > 0


def test_slo_share_counts_requests_whose_mean_token_latency_fits() -> None:
    rows = [token("p", 0, i, 100.0) for i in range(4)] + [token("p", 1, i, 500.0)
                                                          for i in range(4)]
    reqs = [RequestRow("p", r, "edge1", -1, False, 0.0, 0.0, 1.0, 8, 4, 4, 0, 100.0, 400.0, "")
            for r in (0, 1)]
    assert policy_stats("p", rows, reqs, slo_ms=300.0).slo_share == 0.5
    assert policy_stats("p", rows, reqs, slo_ms=600.0).slo_share == 1.0


def test_summary_json_has_exactly_the_design_shape() -> None:
    tokens, requests = make_rows("hetroute", 20.0)
    s = policy_stats("hetroute", tokens, requests, quality_delta_pct=0.5)
    meta = meta_of({"scenario": "x", "runtime": "local", "shaper": "app", "model": "tiny-moe",
                    "seed": 3, "time_dilation": 2})
    out = summary_json(meta, [s])
    assert set(out) == {"scenario", "runtime", "shaper", "model", "seed", "time_dilation",
                        "clock", "virtual_speedup", "policies", "faithful",
                        "unfaithful_reasons", "comparisons", "repeat"}
    assert out["clock"] == "realtime" and out["virtual_speedup"] is None  # an older run.json
    assert out["faithful"] is False and out["unfaithful_reasons"] == ["no latency split"]
    assert out["comparisons"] == []
    p = out["policies"]["hetroute"]
    assert set(p) == POLICY_KEYS
    assert set(p["latency_ms"]) == set(p["ttft_ms"]) == {"mean", "p50", "p95", "p99"}
    assert set(p["mix"]) == {"local_exact", "remote_exact", "cpu_loaded", "substitute",
                             "fallback"}
    assert isinstance(out["time_dilation"], float) and p["quality_delta_pct"] == 0.5
    assert p["overhead_share"] is None and p["loop_lag_ms"] is None  # rows without a split
    assert set(p["emulated_ms"]) == {"mean", "p99"} and p["scoring_failed_tokens"] == 0


def test_a_real_difference_is_significant_and_noise_is_not() -> None:
    a_rows, _ = make_rows("a", 20.0, seed=1)
    same, _ = make_rows("b", 20.0, seed=2)
    slower, _ = make_rows("c", 30.0, seed=3)
    noise = compare("a", a_rows, "b", same)
    assert not noise.significant and noise.verdict() == "no significant difference"
    assert noise.ci_low_pct < 0 < noise.ci_high_pct
    diff = compare("a", a_rows, "c", slower)
    assert diff.significant and diff.verdict() == "higher" and diff.p_value < 0.01
    assert diff.ci_low_pct < diff.change_pct < diff.ci_high_pct
    assert 30 < diff.change_pct < 70  # 20 → 30 ms is +50%, give or take the draws
    assert compare("c", slower, "a", a_rows).verdict() == "lower"


def test_too_few_requests_give_no_interval() -> None:
    one = [token("a", 0, i, 10.0) for i in range(3)]
    two = [token("b", 0, i, 12.0) for i in range(3)]
    c = compare("a", one, "b", two)
    assert c.change_pct == pytest.approx(20.0) and math.isnan(c.ci_low_pct)
    assert not c.significant


def test_rows_round_trip_through_csv(tmp_path: Path) -> None:
    tokens, requests = make_rows("p", 20.0, n_requests=5, fail_request=2)
    assert write_rows(tmp_path / "t.csv", tokens, TokenRow) == len(tokens)
    write_rows(tmp_path / "r.csv", requests, RequestRow)
    back = list(read_rows(tmp_path / "t.csv", TokenRow))
    assert len(back) == len(tokens)
    for a, b in zip(tokens, back, strict=True):
        assert a.status == b.status and a.warmup == b.warmup and a.reason == b.reason
        assert (math.isnan(a.latency_ms) and math.isnan(b.latency_ms)) or \
            a.latency_ms == pytest.approx(b.latency_ms, abs=1e-6)
    assert list(read_rows(tmp_path / "r.csv", RequestRow))[2].failed == 4
    (tmp_path / "bad.csv").write_text("policy,request\nx,1\n")
    with pytest.raises(ValueError, match="missing column"):
        list(read_rows(tmp_path / "bad.csv", TokenRow))
