"""The whole mesh in one partition (`--workers 1`, netem.virtual.partition) gives the rows the
process-per-node reference (the `local` runtime) gives, row for row and column for column but
the host's own time, on the scenarios people run, a node crash and a link cut included; and
runs twice to the bit."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, moemesh_process

SCENARIOS = ROOT / "experiments" / "scenarios"
HOST_ONLY = {"dense_host_ms"}  # the host's own time, measured beside the timeline

CASES = {
    "tiny-quick": ("tiny-quick.yaml",),
    "quickstart": ("quickstart.yaml", "--quality-windows", "0"),
    "fg-access-6s": ("fg-access.yaml", "--duration", "6s", "--quality-windows", "0"),
    "paper-load-6s": ("hetroute-paper-load.yaml", "--policies", "greedy,hetroute",
                      "--duration", "6s", "--quality-windows", "0"),
    # a WAN link cut and a node crash (killed and revived inside the partition)
    "mesh10-crash": (str(ROOT / "docker" / "scenarios" / "mesh10.yaml"), "--runtime", "local",
                     "--quality-windows", "0"),
}


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "tokens.csv").open() as fh:
        return [{k: v for k, v in r.items() if k not in HOST_ONLY} for r in csv.DictReader(fh)]


def _run(out: Path, scenario: str, *flags: str) -> dict:
    done = moemesh_process("run", str(SCENARIOS / scenario), *flags, "--quiet", "--out",
                           str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "run.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_one_partition_gives_the_process_per_node_rows(tmp_path: Path, case: str) -> None:
    scenario, *flags = CASES[case]
    ref = _run(tmp_path / "local", scenario, *flags)
    one = _run(tmp_path / "workers1", scenario, *flags, "--workers", "1")
    want, got = _rows(tmp_path / "local"), _rows(tmp_path / "workers1")
    assert len(want) == len(got) > 0
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a == b, f"row {i}: " + ", ".join(
            f"{k} {a[k]} != {b[k]}" for k in a if a[k] != b[k])
    assert ref["clock_stats"]["virtual_s"] == one["clock_stats"]["virtual_s"]
    assert "workers" not in ref["clock_stats"]
    assert one["clock_stats"]["workers"] == 1 and one["clock_stats"]["advances"] > 0
    assert one["scenario_data"]["workers"] == 1 and "workers" not in ref["scenario_data"]
    def timeline(meta: dict) -> list:
        """Every fault at its instant, and how it went. Not compared: the wall time, and
        when the controller saw a revived node listen (`done_s` of node-up): the process
        runtime polls its port every 50 ms of virtual time, a partition's node listens at
        once; the node itself serves from the same instant in both."""
        return [{k: v for k, v in e.items() if k != "wall_time" and not (
                    k == "done_s" and e["action"] == "node-up")}
                for events in meta["faults"].values() for e in events]

    assert timeline(one) == timeline(ref)
    if case == "tiny-quick":  # and again: the same rows to the bit
        _run(tmp_path / "again", scenario, *flags, "--workers", "1")
        assert _rows(tmp_path / "again") == got


@pytest.mark.parametrize(("changes", "needle"), [
    ({"workers": 2}, "2 partitions side by side are not built yet"),
    ({"workers": 0}, "whole number >= 1"),
    ({"workers": 1, "runtime": "netns"}, "needs runtime local and clock virtual"),
    ({"workers": 1, "clock": "realtime"}, "needs runtime local and clock virtual"),
])
def test_workers_it_cannot_honour_are_refused_naming_the_key(changes: dict, needle: str) -> None:
    from dataclasses import replace

    from orchestrator.scenario.arms import load_experiment

    scenario, _ = load_experiment(SCENARIOS / "tiny-quick.yaml")
    with pytest.raises(ValueError, match=r"^workers: .*" + needle):
        replace(scenario, **changes)

