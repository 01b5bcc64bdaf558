"""An arm's rows do not depend on what ran before it (issue 38): the same arm alone and
third in a run, in virtual time on real node processes, gives the same tokens.csv. Between
them the other arms change the placement, meet a cut link (timeouts, breakers, late
answers), fill the estimators, the GPU caches and the queues, and move the clock."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers import ROOT, moemesh_process

QUICKSTART = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"
HOST_ONLY = {"dense_host_ms"}  # the host's own time, measured beside the timeline


def _rows(folder: Path, policy: str) -> list[dict[str, str]]:
    with (folder / "tokens.csv").open() as fh:
        return [{k: v for k, v in r.items() if k not in HOST_ONLY}
                for r in csv.DictReader(fh) if r["policy"] == policy]


@pytest.mark.slow
def test_an_arm_alone_and_third_gives_the_same_rows(tmp_path: Path) -> None:
    text = QUICKSTART.read_text()
    old = "policies: [local-first, greedy, hetroute, hetroute+ordermoe]"
    assert old in text
    scenario = tmp_path / "arms.yaml"
    scenario.write_text(text.replace(old, (
        "policies:\n  - local-first\n"
        "  - {label: om, policy: ordermoe, placement: ordermoe}\n  - greedy\n")).replace(
        "topologies/", str(QUICKSTART.parent / "topologies") + "/"))
    outs = {}
    for name, arms in (("alone", "greedy"), ("third", "local-first,om,greedy")):
        out = tmp_path / name
        # 6 s: the link cut at 5 s falls inside every arm
        done = moemesh_process("run", str(scenario), "--duration", "6s", "--quality-windows",
                               "1", "--policies", arms, "--quiet", "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        outs[name] = out
    alone, third = _rows(outs["alone"], "greedy"), _rows(outs["third"], "greedy")
    assert len(alone) > 100
    assert {r["policy"] for r in _rows(outs["third"], "om")} == {"om"}  # the others did run
    assert alone == third
