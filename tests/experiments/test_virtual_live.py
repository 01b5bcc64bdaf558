"""Runs in virtual time (netem.virtual) on real node processes (the local runtime, the app
shaper): exact and repeatable, a node that dies with no fault scheduled is named and does not
freeze the clock, and the clock choices that cannot be honoured are clear errors."""

from __future__ import annotations

import csv
import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.run.clock import resolve_clock
from experiments.run.live import open_live
from experiments.run.progress import RunProgress
from experiments.run.runner import RunOptions, run_experiment, shorten
from netem.virtual import run_on_clock
from orchestrator.scenario.arms import load_experiment
from orchestrator.scenario.scenario import Scenario
from tests.helpers import ROOT, moemesh, moemesh_process, processes_with

TINY_QUICK = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"
HOST_ONLY = {"dense_host_ms"}  # the host's own time, measured beside the timeline


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "tokens.csv").open() as fh:
        return [{k: v for k, v in r.items() if k not in HOST_ONLY} for r in csv.DictReader(fh)]


@pytest.mark.slow
def test_a_virtual_run_is_exact_and_repeats_to_the_bit(tmp_path: Path) -> None:
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        done = moemesh_process("run", str(TINY_QUICK), "--requests", "6", "--quality-windows",
                               "1", "--policies", "local-first,hetroute", "--quiet", "--out",
                               str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        outs.append(out)
    first, second = _rows(outs[0]), _rows(outs[1])
    assert first and first == second  # latency, emulated split, routing: identical
    a, b = (json.loads((o / "summary.json").read_text()) for o in outs)
    assert a["clock"] == "virtual" and a["virtual_speedup"] > 0
    assert a["time_dilation"] == 1.0 and a["faithful"], a["unfaithful_reasons"]
    for name, p in a["policies"].items():
        assert p["overhead_share"] == pytest.approx(0.0, abs=1e-9)  # by construction
        assert p["quality_delta_pct"] == b["policies"][name]["quality_delta_pct"]
        assert p["latency_ms"] == b["policies"][name]["latency_ms"]
    for r in first:  # the measured latency is the emulated latency
        if r["status"] == "ok":
            assert float(r["latency_ms"]) == pytest.approx(float(r["emulated_ms"]), abs=2e-4)
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["clock"] == "virtual" and run["clock_stats"]["advances"] > 0
    assert "virtual" in (outs[0] / "report.md").read_text()


@pytest.mark.slow
def test_a_moving_aggregation_server_repeats_to_the_bit(tmp_path: Path) -> None:
    """HetRoute's moving aggregation server (router.aggregate) books hops and answers on other
    nodes' links: each node books them in the order of their times, so two runs agree."""
    text = TINY_QUICK.read_text()
    old = "policies: [local-first, greedy, hetroute, hetroute+ordermoe]"
    assert old in text
    scenario = tmp_path / "moving.yaml"
    scenario.write_text(text.replace(old, "policies:\n  - hetroute\n  - {policy: hetroute, "
                                          "dense: aggregate, label: moving}\n").replace(
        "topologies/", str(TINY_QUICK.parent / "topologies") + "/"))
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        done = moemesh_process("run", str(scenario), "--requests", "6", "--quality-windows",
                               "0", "--policies", "moving", "--quiet", "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        outs.append(out)
    first, second = _rows(outs[0]), _rows(outs[1])
    assert first and first == second
    assert all(r["status"] == "ok" for r in first)
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["dense"]["moving"]["mode"] == "aggregate"


@pytest.mark.slow
def test_a_node_killed_with_no_fault_is_named_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario, arms = load_experiment(TINY_QUICK)
    scenario, _ = shorten(scenario, duration_s=6.0)
    scenario = replace(scenario, faults=())
    scenario, _ = resolve_clock(scenario)
    arms = tuple(a for a in arms if a.label == "hetroute")
    killed: list[int] = []
    seen = RunProgress.on_request

    def kill_edge3_after_the_first_request(self, row, tokens) -> None:
        seen(self, row, tokens)
        if not killed:  # mid-arm: the workload is under way (a request came back)
            pids = processes_with("--name edge3 ", mine=True)
            assert pids, "edge3's node process was not found"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.extend(pids)

    monkeypatch.setattr(RunProgress, "on_request", kill_edge3_after_the_first_request)
    out = tmp_path / "run"
    run_on_clock(run_experiment(scenario, arms, open_live, out,
                                RunOptions(quality_windows=0, quiet=True)), virtual=True)
    assert killed
    run = json.loads((out / "run.json").read_text())
    assert [d["node"] for d in run["clock_stats"]["deaths"]] == ["edge3"]
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["faithful"]
    assert any("node died" in r and "edge3" in r for r in summary["unfaithful_reasons"])
    assert summary["policies"]["hetroute"]["tokens"] > 0  # the others served on
    assert processes_with("--name edge", mine=True) == []  # not another run's nodes


def _scenario_text(**keys: str) -> str:
    text = TINY_QUICK.read_text()
    for key, value in keys.items():
        text = text.replace(f"\n{key}: ", f"\n{key}: {value}  # was: ", 1)
    return text


def test_virtual_time_refuses_what_it_cannot_emulate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    topo = ROOT / "experiments" / "scenarios" / "topologies"
    bad = tmp_path / "tc.yaml"
    bad.write_text(_scenario_text(runtime="netns", shaper="tc").replace(
        "topologies/edge5.yaml", str(topo / "edge5.yaml")))
    assert moemesh("scenario", "check", str(bad)) == 2
    err = capsys.readouterr().err
    assert "clock" in err and "kernel delays packets in real time" in err
    docker = tmp_path / "docker.yaml"  # one host's clock: containers yes, a Swarm stack no
    docker.write_text(_scenario_text(runtime="docker").replace(
        "topologies/edge5.yaml", str(topo / "edge5.yaml")))
    assert moemesh("scenario", "check", str(docker)) == 0
    capsys.readouterr()
    monkeypatch.setenv("MOEMESH_SWARM_SERVICE", "mm_controller")  # as Swarm expands it
    assert moemesh("scenario", "check", str(docker)) == 2
    assert "Swarm: a stack's nodes may run on other hosts" in capsys.readouterr().err
    monkeypatch.delenv("MOEMESH_SWARM_SERVICE")
    assert moemesh("run", str(TINY_QUICK), "--clock", "virtual", "--tdf", "2",
                   "--out", str(tmp_path / "x")) == 2
    assert "nothing to dilate" in capsys.readouterr().err


def test_auto_picks_virtual_where_it_can_and_says_so() -> None:
    scenario, _ = load_experiment(TINY_QUICK)
    v, notes = resolve_clock(replace(scenario, clock="auto"))
    assert v.clock == "virtual" and v.time_dilation == 1.0 and not v.auto_dilation
    assert any("virtual time" in n for n in notes)
    tc = Scenario(**{**{f: getattr(scenario, f) for f in scenario.__dataclass_fields__},
                     "clock": "auto", "runtime": "netns", "shaper": "tc"})
    r, notes = resolve_clock(tc)
    assert r.clock == "realtime" and any("kernel delays packets" in n for n in notes)
    # an explicit dilation on a virtual scenario asks for the wall clock
    assert resolve_clock(replace(scenario, clock="realtime"))[0].clock == "realtime"


@pytest.mark.slow
def test_virtual_and_real_time_tell_the_same_story(tmp_path: Path) -> None:
    """`--clock both` (what CI runs as the cross-check): the realtime run's own emulated
    timeline equals virtual time's, and its measured mean differs by its host share."""
    out = tmp_path / "clocks"
    done = moemesh_process("run", str(TINY_QUICK), "--clock", "both", "--requests", "6",
                           "--quality-windows", "0", "--tdf", "8",
                           "--policies", "greedy,hetroute", "--quiet", "--out", str(out),
                           timeout_s=900)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((out / "crosscheck.json").read_text())
    assert "Virtual against real time" in (out / "crosscheck.md").read_text()
    assert json.loads((out / "virtual" / "summary.json").read_text())["clock"] == "virtual"
    real = json.loads((out / "realtime" / "summary.json").read_text())
    assert real["clock"] == "realtime" and real["time_dilation"] == 8.0
    assert set(data["policies"]) == {"greedy", "hetroute"}
    for name, e in data["policies"].items():
        assert abs(e["emulated_mean"]["change_pct"]) <= 1.0, (name, e)
        # the host's share s of each realtime token: realtime = emulated / (1 - s)
        s = e["realtime_overhead_share"]
        assert e["mean"]["change_pct"] == pytest.approx(100 * s / (1 - s), abs=1.0), (name, e)
