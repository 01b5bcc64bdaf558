"""Iteration-level batching (router.batching) in a virtual-time run on real node processes:
two runs agree to the bit, run.json says the run batched, and every token is recorded."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT, moemesh_process

QUICKSTART = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"  # tiny-moe: quick
HOST_ONLY = {"dense_host_ms"}  # the host's own time, measured beside the timeline


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "tokens.csv").open() as fh:
        return [{k: v for k, v in r.items() if k not in HOST_ONLY} for r in csv.DictReader(fh)]


@pytest.mark.slow
def test_a_batched_run_repeats_to_the_bit(tmp_path: Path) -> None:
    text = QUICKSTART.read_text().replace(
        "topologies/", str(QUICKSTART.parent / "topologies") + "/")
    scenario = tmp_path / "batched.yaml"
    scenario.write_text(text + "\nbatching: {mode: iteration, max_rows: 128}\n")
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        done = moemesh_process("run", str(scenario), "--requests", "10", "--quality-windows",
                               "0", "--policies", "greedy,hetroute", "--quiet", "--out",
                               str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        outs.append(out)
    first, second = _rows(outs[0]), _rows(outs[1])
    assert first and first == second  # latency, emulated split, routing: identical
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["batching"]["mode"] == "iteration"
    assert run["batching"]["arms"] == ["greedy", "hetroute"]
    ok = [r for r in first if r["status"] == "ok"]
    assert len(ok) >= 0.9 * len(first)
    for r in ok:  # in virtual time the measured latency is the emulated latency
        assert float(r["latency_ms"]) == pytest.approx(float(r["emulated_ms"]), abs=2e-4)


@pytest.mark.slow
def test_an_arm_unbatched_in_a_batched_scenario_runs_as_the_unbatched_scenario(
        tmp_path: Path) -> None:
    """An arm's `batching: none` (orchestrator.scenario.arms) is the scenario's `batching: none` for
    that arm, token for token, beside a batched arm in the same run."""
    text = QUICKSTART.read_text().replace(
        "topologies/", str(QUICKSTART.parent / "topologies") + "/")
    plain = tmp_path / "plain.yaml"
    plain.write_text(text)
    listed = re.search(r"^policies: \[.*\]\n", text, re.M)
    assert listed is not None
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(text.replace(listed.group(0), (
        "policies:\n  - hetroute\n"
        "  - {policy: greedy, batching: none, label: greedy-unbatched}\n"))
        + "\nbatching: {mode: iteration, max_rows: 128}\n")
    rows = {}
    for name, scenario, policies in (("plain", plain, "greedy"),
                                     ("mixed", mixed, "hetroute,greedy-unbatched")):
        out = tmp_path / name
        done = moemesh_process("run", str(scenario), "--requests", "10", "--quality-windows",
                               "0", "--policies", policies, "--quiet", "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        rows[name] = _rows(out)
        if name == "mixed":
            run = json.loads((out / "run.json").read_text())
            assert run["batching"]["arms"] == ["hetroute"]
    unbatched = [{k: v for k, v in r.items() if k != "policy"}
                 for r in rows["mixed"] if r["policy"] == "greedy-unbatched"]
    alone = [{k: v for k, v in r.items() if k != "policy"} for r in rows["plain"]]
    assert alone and unbatched == alone
