"""`charge_planning` (issue 39 item 3): the router's planning on the emulated timeline, read
from the scenario, and a real run in virtual time whose tokens carry it."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from orchestrator.scenario.arms import load_experiment, parse_arm
from orchestrator.scenario.yamlio import InputError
from router.settings import Settings
from tests.helpers import ROOT, moemesh_process

SCENARIOS = ROOT / "experiments" / "scenarios"


def _tiny_quick(tmp_path: Path, extra: str, moving: bool = False) -> Path:
    text = (SCENARIOS / "tiny-quick.yaml").read_text().replace(
        "topology: topologies/", f"topology: {SCENARIOS}/topologies/")
    if moving:  # HetRoute at home and on the moving aggregation server (router.aggregate)
        text = re.sub(r"^policies:.*$", "policies:\n  - hetroute\n  - {label: moving, "
                      "policy: hetroute, dense: aggregate}", text, flags=re.M)
    path = tmp_path / "tq.yaml"
    path.write_text(text + extra)
    return path


def test_charge_planning_is_read_and_handed_to_every_arm(tmp_path: Path) -> None:
    sc, _ = load_experiment(_tiny_quick(tmp_path, "charge_planning: true\n"))
    assert sc.charge_planning == 1.0
    assert parse_arm("hetroute").router_settings(sc) == {"charge_planning": 1.0}
    own = parse_arm({"policy": "greedy", "settings": {"charge_planning": 0.5}})
    assert own.router_settings(sc) == {"charge_planning": 0.5}  # the arm's own rules
    off, _ = load_experiment(_tiny_quick(tmp_path, ""))
    assert off.charge_planning == 0.0 and parse_arm("hetroute").router_settings(off) == {}
    # under time dilation the charge is stretched as the deadlines are
    assert Settings(charge_planning=1.0).dilated(4.0).charge_planning == 4.0
    path = _tiny_quick(tmp_path, "charge_planning: lots\n")
    line = len(path.read_text().splitlines())
    with pytest.raises(InputError) as err:
        load_experiment(path)
    assert str(err.value).startswith(f"{path}:{line}: charge_planning: must be true, false or "
                                     "a factor >= 0"), str(err.value)


@pytest.mark.slow
def test_a_charged_run_puts_each_tokens_planning_on_its_timeline(tmp_path: Path) -> None:
    """Every token that planned a layer carries plan_ms > 0, at home and on the moving
    aggregation server, and it is part of the emulated latency (which is the measured latency
    in virtual time); without the key it is 0."""
    outs = {}
    for name, extra in (("on", "charge_planning: true\n"), ("off", "")):
        out = tmp_path / name
        done = moemesh_process("run", str(_tiny_quick(tmp_path, extra, moving=True)),
                               "--requests", "4", "--quality-windows", "0", "--quiet",
                               "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        with (out / "tokens.csv").open() as fh:
            outs[name] = [r for r in csv.DictReader(fh) if r["status"] == "ok"]
    on, off = outs["on"], outs["off"]
    assert on and len(on) == len(off)
    assert {r["policy"] for r in on} == {"hetroute", "moving"}
    parts = ("link_ms", "queue_ms", "load_ms", "compute_ms", "dense_ms", "plan_ms")
    for r in on:
        assert float(r["plan_ms"]) > 0, r
        assert float(r["emulated_ms"]) == pytest.approx(sum(float(r[k]) for k in parts),
                                                        abs=1e-3)
        assert float(r["latency_ms"]) == pytest.approx(float(r["emulated_ms"]), abs=2e-4)
    assert all(float(r["plan_ms"]) == 0 for r in off)
    mean = {k: sum(float(r["latency_ms"]) for r in v) / len(v) for k, v in outs.items()}
    assert mean["on"] > mean["off"]
    run = json.loads((tmp_path / "on" / "run.json").read_text())
    assert run["scenario_data"]["charge_planning"] == 1.0
