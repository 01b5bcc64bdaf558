"""Pre-registered claims (orchestrator.scenario.claims): parsing with errors naming the field, the
verdict rule, the file's sha256, and the report's section and p-value mark (experiments)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.analysis.metrics import Comparison
from experiments.analysis.paired import METRICS
from experiments.analysis.prereg import judge_run, prereg_lines
from experiments.report.report import p_disagrees
from experiments.run.runmeta import RunMeta
from orchestrator.scenario.arms import load_experiment
from orchestrator.scenario.claims import CLAIM_METRICS, Claim, judge
from orchestrator.scenario.scenario import scenario_from_data, scenario_to_data
from orchestrator.scenario.yamlio import InputError, Loc
from tests.experiments.conftest import make_rows

HEAD = """\
topology:
  nodes:
    - {name: a, profile: hetroute-s}
    - {name: b, profile: hetroute-m}
  defaults: {delay_ms: 2ms, rate_mbit: 1gbit}
workload: {rate_rps: 2, duration: 20s}
policies: [greedy, hetroute, {policy: hetroute, dense: aggregate, label: moving}]
"""


def _load(tmp_path: Path, claims: str) -> tuple:
    path = tmp_path / "s.yaml"
    path.write_text(HEAD + claims)
    return load_experiment(path)


def test_claims_are_read_kept_and_hashed(tmp_path: Path) -> None:
    scenario, _ = _load(tmp_path, "claims:\n"
                           "  - {metric: ttft, policy: moving, baseline: greedy, "
                           "direction: lower, min_effect_pct: 5}\n")
    assert scenario.claims == (Claim("ttft", "moving", "greedy", "lower", 5.0),)
    assert scenario.source_sha256 == hashlib.sha256((tmp_path / "s.yaml").read_bytes()
                                                    ).hexdigest()
    data = scenario_to_data(scenario)
    assert data["claims"] == [{"metric": "ttft", "policy": "moving", "baseline": "greedy",
                               "direction": "lower", "min_effect_pct": 5.0}]
    assert scenario_from_data(data, Loc("x"), tmp_path).claims == scenario.claims
    assert set(CLAIM_METRICS) == set(METRICS)  # the two lists agree


@pytest.mark.parametrize(("claims", "expected"), [
    ("claims: 3\n", r"s.yaml:\d+.*claims.*must be a list of claims"),
    ("claims:\n  - {metric: speed, policy: hetroute, baseline: greedy, direction: lower}\n",
     r"claims\[0\].*metric: must be one of mean_latency.*got 'speed'"),
    ("claims:\n  - {metric: traffic, policy: hetroute, baseline: greedy, direction: down}\n",
     r"claims\[0\].*direction: must be one of lower, higher, got 'down'"),
    ("claims:\n  - {metric: traffic, policy: hetroute, baseline: greedy}\n",
     r"claims\[0\].*missing field\(s\) direction"),
    ("claims:\n  - {metric: traffic, policy: hetroute, baseline: greedy, direction: lower, "
     "by: 3}\n", r"claims\[0\].*unknown key\(s\) by"),
    ("claims:\n  - {metric: traffic, policy: hetroute, baseline: hetroute, direction: lower}\n",
     r"baseline: must differ from policy"),
    ("claims:\n  - {metric: traffic, policy: hetroute, baseline: greedy, direction: lower, "
     "min_effect_pct: -1}\n", r"min_effect_pct: must be a number in 0..100"),
    ("claims:\n  - {metric: traffic, policy: edgeshard, baseline: greedy, direction: lower}\n",
     r"s.yaml:\d+.*claims\[0\].policy: no arm 'edgeshard' in the scenario \(arms: greedy, "
     r"hetroute, moving\)"),
])
def test_bad_claims_name_the_entry_and_the_field(tmp_path: Path, claims: str,
                                                 expected: str) -> None:
    with pytest.raises(InputError, match=expected):
        _load(tmp_path, claims)


def test_the_verdict_follows_the_ci_and_the_minimum_effect() -> None:
    lower = Claim("mean_latency", "h", "g", "lower")
    assert judge(lower, -9.0, -1.0) == "held"
    assert judge(lower, -9.0, 0.5) == "not held"
    assert judge(lower, 0.5, 9.0) == "reversed"
    assert judge(lower, math.nan, math.nan) == "n/a"
    assert judge(replace(lower, min_effect_pct=2.0), -9.0, -1.0) == "not held"
    higher = Claim("traffic", "h", "g", "higher", 1.0)
    assert judge(higher, 1.5, 4.0) == "held" and judge(higher, -4.0, -1.0) == "reversed"


def test_a_run_judges_exactly_its_claims_and_states_its_hash() -> None:
    g, _ = make_rows("greedy", 20.0, seed=1)
    h = [replace(t, policy="hetroute", latency_ms=t.latency_ms * 0.8) for t in g]
    meta = RunMeta.from_json({"scenario": "s", "arms": [], "seed": 3,
                              "scenario_sha256": "f" * 64,
            "claims": [{"metric": "mean_latency", "policy": "hetroute", "baseline": "greedy",
                        "direction": "lower"},
                       {"metric": "mean_latency", "policy": "greedy", "baseline": "hetroute",
                        "direction": "lower"},
                       {"metric": "traffic", "policy": "moving", "baseline": "greedy",
                        "direction": "lower"}]})
    judged = judge_run(meta, {"greedy": g, "hetroute": h})
    assert [j["verdict"] for j in judged] == ["held", "reversed", "n/a (arm not run)"]
    assert judged[0]["change_pct"] == pytest.approx(-20.0)
    text = "\n".join(prereg_lines(meta, {"greedy": g, "hetroute": h}))
    assert "f" * 64 in text and "| hetroute lower than greedy on mean_latency | -20.0% |" in text
    none = "\n".join(prereg_lines(RunMeta(scenario="s", arms=(), seed=1), {"greedy": g}))
    assert "states no claims" in none and "no sha256" in none


def test_a_p_value_that_disagrees_with_the_ci_is_marked() -> None:
    def comp(p: float, lo: float, hi: float) -> Comparison:
        return Comparison("mean_latency", "a", "b", 1.0, 1.0, 0.0, lo, hi, p, 10, 10, True)

    assert p_disagrees(comp(0.0061, -1.0, 0.5))  # the row: p small, CI holds 0
    assert comp(0.0061, -1.0, 0.5).verdict() == "no significant difference"
    assert p_disagrees(comp(0.3, -3.0, -1.0))
    assert not p_disagrees(comp(0.01, -3.0, -1.0)) and not p_disagrees(comp(0.4, -1.0, 1.0))
    assert not p_disagrees(comp(math.nan, -3.0, -1.0))
    assert comp(0.01, -3.0, -1.0).summary_entry()["verdict_rule"] == "ci95"
