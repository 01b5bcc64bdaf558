"""EdgeShard pipelined, end to end (issue 25 item 3): a live mesh (real node processes, local
runtime, virtual time) runs the pipelined arm first, then hetroute. Every token of the
pipelined arm runs each layer on its pipeline's stage, run.json and the report say where the
dense part and the KV cache were, and the link probe and the fidelity table are as good as
without it (the probe runs on the placement that leaves no node empty; a pipelined layer's
one-way hop is not read as a round trip)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from experiments.run.live import open_live
from experiments.run.rows import TokenRow, read_rows
from experiments.run.runner import RunOptions, run_experiment
from orchestrator.scenario.arms import load_experiment

SCENARIO = """
name: pipelined
topology:
  nodes:
    - {name: edge1, profile: tiny-edge, users: 3}
    - {name: edge2, profile: tiny-edge, users: 1}
    - {name: edge3, profile: tiny-edge, users: 1}
    - {name: edge4, profile: tiny-edge, users: 1}
  defaults: {delay_ms: 2ms, rate_mbit: 200mbit}
model: tiny-moe
runtime: local
shaper: app
clock: virtual
placement: {policy: hetroute, redundancy: 2.0, variants: [fp16, int8]}
policies:
  - {label: edgeshard, policy: greedy, placement: edgeshard, dense: pipeline}
  - hetroute
workload: {arrival: poisson, rate_rps: 4, prompt_tokens: [8, 16], gen_tokens: 4,
           duration: 3s, seed: 2}
"""


@pytest.mark.slow
def test_a_pipelined_arm_runs_on_its_stages_and_the_run_says_so(tmp_path: Path) -> None:
    path = tmp_path / "pipelined.yaml"
    path.write_text(SCENARIO)
    scenario, arms = load_experiment(path)
    out = tmp_path / "out"
    meta = asyncio.run(run_experiment(scenario, arms, open_live, out,
                                      RunOptions(quality_windows=0, quiet=True)))
    dense = meta.dense
    assert dense["hetroute"]["mode"] == "home"
    piped = dense["edgeshard"]
    assert piped["mode"] == "pipeline" and len(piped["pipelines"]) == 2  # redundancy 2.0
    layers = len(piped["pipelines"][0])
    for kv in piped["kv_bytes_per_token"]:  # every layer's KV cache on one stage
        assert sum(kv.values()) == layers * piped["kv_bytes_per_layer_token"] \
            == piped["kv_bytes_per_token_at_home"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policies"]["edgeshard"]["failed_tokens"] == 0
    assert summary["fidelity"]["within_limits"], summary["fidelity"]["off"]
    text = (out / "report.md").read_text()
    assert "## Where the dense part runs" in text and "→" in text
    # every expert ran on the stage the token's layer was on: local, none remote
    rows = [r for r in read_rows(out / "tokens.csv", TokenRow) if r.policy == "edgeshard"]
    assert rows and all(r.status == "ok" for r in rows)
    assert all(r.remote_exact == 0 and r.local == 2 * layers for r in rows)  # top-2
    het = [r for r in read_rows(out / "tokens.csv", TokenRow) if r.policy == "hetroute"]
    assert sum(r.remote_exact for r in het) > 0  # the other arm does go remote
