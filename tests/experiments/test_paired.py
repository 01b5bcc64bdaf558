"""Comparisons paired by request (experiments.analysis.paired) and the repetitions' orders."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from experiments.analysis.paired import paired_compare
from experiments.run.repeats import base_label, rep_label, rep_of, rep_orders
from experiments.run.rows import TokenRow
from tests.experiments.conftest import make_rows, token


def _shifted(rows: list[TokenRow], policy: str, factor: float, noise: float = 0.0,
             seed: int = 9) -> list[TokenRow]:
    """The same requests under another policy: each token `factor` times as slow, with a
    little independent noise (the request's own level carries over, as on one mesh)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in rows:
        if t.ok:
            lat = t.latency_ms * factor * float(rng.lognormal(0.0, noise)) if noise else \
                t.latency_ms * factor
            out.append(replace(t, policy=policy, latency_ms=lat))
        else:
            out.append(replace(t, policy=policy))
    return out


def test_a_known_shift_is_found_with_a_paired_interval_that_excludes_zero() -> None:
    a, _ = make_rows("a", 20.0, seed=1)
    b = _shifted(a, "b", 1.05, noise=0.05)  # +5%: small beside the spread between requests
    c = paired_compare("a", a, "b", b, "mean_latency", seed=3)
    assert c.paired and c.n_a == c.n_b == 36  # 40 requests, 4 in the warm-up
    assert c.significant and c.verdict() == "higher" and c.ci_low_pct > 0
    assert c.ci_low_pct < c.change_pct < c.ci_high_pct
    assert 3.0 < c.change_pct < 7.0 and c.ci_high_pct - c.ci_low_pct < 4.0
    assert c.p_value < 0.01 and c.mean_diff > 0
    p99 = paired_compare("a", a, "b", b, "p99_latency", seed=3)
    assert p99.ci_low_pct <= p99.change_pct <= p99.ci_high_pct
    assert math.isnan(p99.p_value)


def test_pairing_is_what_makes_a_small_shift_visible() -> None:
    from experiments.analysis.metrics import compare

    a, _ = make_rows("a", 20.0, seed=1)
    b = _shifted(a, "b", 1.05, noise=0.05)
    unpaired = compare("a", a, "b", b, "latency_ms", seed=3)
    paired = paired_compare("a", a, "b", b, "mean_latency", seed=3)
    assert not unpaired.significant  # the requests' own spread hides +5% ...
    assert (paired.ci_high_pct - paired.ci_low_pct) < \
        (unpaired.ci_high_pct - unpaired.ci_low_pct) / 3  # ... pairing removes it


def test_identical_inputs_give_an_interval_that_holds_zero() -> None:
    a, _ = make_rows("a", 20.0, seed=1)
    b = [replace(t, policy="b") for t in a]
    for metric in ("mean_latency", "p99_latency", "traffic"):
        c = paired_compare("a", a, "b", b, metric, seed=0)
        assert c.change_pct == 0.0 and c.ci_low_pct <= 0.0 <= c.ci_high_pct, metric
        assert not c.significant and c.verdict() == "no significant difference"


def test_the_interval_is_seeded_and_only_paired_requests_count() -> None:
    a, _ = make_rows("a", 20.0, seed=1)
    b = _shifted(a, "b", 0.9, noise=0.1)
    one = paired_compare("a", a, "b", b, seed=7)
    assert paired_compare("a", a, "b", b, seed=7) == one
    assert paired_compare("a", a, "b", b, seed=8).ci_low_pct != one.ci_low_pct
    # a request only one side completed is left out of the pairs
    dropped = [t for t in b if t.request != 10]
    assert paired_compare("a", a, "b", dropped, seed=7).n_a == one.n_a - 1
    assert paired_compare("a", a, "b", [], seed=7).n_a == 0


def test_repetitions_of_a_request_are_pooled_into_that_request() -> None:
    a = [token("a", r, i, 10.0 + r) for r in range(6) for i in range(3)]
    again = [replace(t, rep=1, latency_ms=t.latency_ms + 2.0) for t in a]
    b = [replace(t, policy="b", latency_ms=t.latency_ms * 1.1) for t in a + again]
    c = paired_compare("a", a + again, "b", b)
    assert c.n_a == 6 and c.change_pct == pytest.approx(10.0)


def test_unknown_metrics_are_refused() -> None:
    with pytest.raises(ValueError, match="metric must be one of"):
        paired_compare("a", [], "b", [], "median")


def test_each_pair_of_repetitions_balances_the_arms_positions() -> None:
    arms = ["a", "b", "c", "d"]
    orders = rep_orders(arms, 4)
    assert orders[0] == arms and orders[1] == arms[::-1]
    assert orders[2] == ["b", "c", "d", "a"] and orders[3] == ["a", "d", "c", "b"]
    for k in (0, 2):
        pos = {x: orders[k].index(x) + orders[k + 1].index(x) for x in arms}
        assert len(set(pos.values())) == 1  # a linear drift hits every arm alike
    assert rep_orders(arms, 1) == [arms]
    assert all(sorted(o) == arms for o in rep_orders(arms, 9))
    with pytest.raises(ValueError):
        rep_orders(arms, 0)


def test_repetition_keys_round_trip() -> None:
    assert rep_label("hetroute@layer-shard", 0) == "hetroute@layer-shard"
    key = rep_label("hetroute@layer-shard", 3)
    assert base_label(key) == "hetroute@layer-shard" and rep_of(key) == 3
    assert base_label("greedy") == "greedy" and rep_of("greedy") == 0


def test_failing_ten_percent_of_tokens_cannot_look_faster_than_completing_them_slowly() -> None:
    """Synthetic rows: policy `slow` completes every token, 10% of them (the slow ones) at
    5x the latency; policy `fails` is the same run with exactly those tokens failed. Dropping
    failed tokens would make `fails` ~30% faster; with the rule (a failed token counts at the
    slowest completed latency of the run) it is never faster, on either latency metric, and
    neither is it when compared the other way round."""
    rng = np.random.default_rng(4)
    slow, fails = [], []
    for r in range(40):
        for i in range(10):
            lat = 20.0 * float(rng.lognormal(0.0, 0.1))
            if i == 3:  # one token in ten is slow
                lat *= 5.0
                fails.append(token("fails", r, i, 0.0, ok=False, reason="deadline"))
            else:
                fails.append(token("fails", r, i, lat))
            slow.append(token("slow", r, i, lat))
    plain = paired_compare("slow", slow, "fails", fails, "mean_latency", seed=1)
    assert plain.change_pct < -20  # the trap: dropping failed tokens rewards failing
    from experiments.analysis.paired import failed_charge

    charge = failed_charge(slow, fails)
    assert charge == max(t.latency_ms for t in slow)
    for metric in ("mean_latency", "p99_latency"):
        c = paired_compare("slow", slow, "fails", fails, metric, seed=1, failed_at=charge)
        assert c.change_pct >= 0 and c.verdict() != "lower", (metric, c)
        back = paired_compare("fails", fails, "slow", slow, metric, seed=1, failed_at=charge)
        assert back.change_pct <= 0 and back.verdict() != "higher", (metric, back)
    # the report's comparisons apply the rule, and say the failed share beside the latency
    from experiments.analysis.metrics import policy_stats
    from experiments.report.report import comparisons
    from experiments.run.runmeta import RunMeta

    meta = RunMeta.from_json({"scenario": "s", "seed": 1, "arms": [{"label": "slow"},
                                                                  {"label": "fails"}]})
    stats = [policy_stats(n, rows, [], warmup_s=0.0, slo_ms=100.0)
             for n, rows in (("slow", slow), ("fails", fails))]
    assert stats[1].failed_measured == 40 and stats[1].measured_tokens == 360
    comps = comparisons(meta, stats, {"slow": slow, "fails": fails})
    assert all(c.change_pct >= 0 for c in comps if c.metric != "traffic")
