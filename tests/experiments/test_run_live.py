"""End to end on real node processes (the `local` runtime: loopback, the `app` shaper).

`test_shortened_quickstart` is what CI runs: the README's main job, shortened with
`--requests`, then checks summary.json's schema (docs/contracts.md) and that every token issued is
accounted for. `test_faults_happen_and_nothing_is_left_behind` runs a link cut and a node kill
through the same runner and checks they are recorded, undone and felt by the tokens.
"""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from experiments.run.live import open_live
from experiments.run.rows import TokenRow, read_rows
from experiments.run.runner import RunOptions, run_experiment
from orchestrator import lockfile
from orchestrator.mesh.chaos import Invariants
from orchestrator.scenario.arms import load_experiment
from tests.helpers import ROOT, moemesh, moemesh_process, processes_with

QUICKSTART = ROOT / "experiments" / "scenarios" / "quickstart.yaml"
MIX = {"local_exact", "remote_exact", "cpu_loaded", "substitute", "fallback"}
PERCENTILES = {"mean", "p50", "p95", "p99"}


def _check_summary(summary: dict, policies: list[str]) -> None:
    assert set(summary) >= {"scenario", "runtime", "shaper", "model", "seed", "time_dilation",
                            "policies", "faithful", "unfaithful_reasons", "comparisons"}
    assert isinstance(summary["seed"], int) and isinstance(summary["time_dilation"], float)
    assert isinstance(summary["faithful"], bool)
    assert summary["faithful"] == (summary["unfaithful_reasons"] == [])
    assert list(summary["policies"]) == policies
    for c in summary["comparisons"]:
        assert set(c) >= {"policy", "against", "metric", "change_pct", "paired_ci_pct"}
    for p in summary["policies"].values():
        assert set(p) >= {"tokens", "failed_tokens", "rerouted_tokens", "latency_ms", "ttft_ms",
                          "throughput_tok_s", "traffic_bytes", "quality_delta_pct", "mix",
                          "overhead_share", "emulated_ms", "loop_lag_ms",
                          "scoring_failed_tokens"}
        assert isinstance(p["scoring_failed_tokens"], int)
        assert set(p["latency_ms"]) == set(p["ttft_ms"]) == PERCENTILES
        assert set(p["mix"]) == MIX
        for key in ("tokens", "failed_tokens", "rerouted_tokens", "traffic_bytes"):
            assert isinstance(p[key], int) and p[key] >= 0


def _issued(folder: Path) -> tuple[Counter, Counter, Counter]:
    """Per policy: token rows, tokens asked for by the requests, ok rows."""
    rows, ok, asked = Counter(), Counter(), Counter()
    with (folder / "tokens.csv").open() as fh:
        for r in csv.DictReader(fh):
            rows[r["policy"]] += 1
            ok[r["policy"]] += r["status"] == "ok"
    with (folder / "requests.csv").open() as fh:
        for r in csv.DictReader(fh):
            asked[r["policy"]] += int(r["gen_tokens"])
    return rows, asked, ok


@pytest.mark.slow
def test_shortened_quickstart(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    done = moemesh_process("run", str(QUICKSTART), "--requests", "4", "--quality-windows",
                           "1", "--overhead-requests", "2", "--tdf", "2", "--quiet",
                           "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    _, arms = load_experiment(QUICKSTART)
    _check_summary(summary, [a.label for a in arms])
    assert (summary["scenario"], summary["runtime"], summary["shaper"]) == (
        "quickstart", "local", "app")
    rows, asked, ok = _issued(out)
    for name, p in summary["policies"].items():
        # completed + failed = issued: every token the requests asked for has a row
        assert p["tokens"] + p["failed_tokens"] == rows[name] == asked[name] > 0
        assert p["tokens"] == ok[name] > 0
        assert p["latency_ms"]["p50"] <= p["latency_ms"]["p99"]
        assert p["quality_delta_pct"] is not None
    text = (out / "report.md").read_text()
    assert "Emulator overhead: the first 2 requests" in text and "| time dilation | 2" in text
    # the packages that can change results, at this process's versions, and the lock's hash
    meta = json.loads((out / "run.json").read_text())
    assert meta["versions"] == lockfile.versions()
    assert {"torch", "numpy", "msgpack", "aiohttp", "PyYAML"} <= set(meta["versions"])
    assert all(meta["versions"][k] for k in ("torch", "numpy", "msgpack", "aiohttp"))
    assert meta["lock_sha256"] == lockfile.lock_sha256() and len(meta["lock_sha256"]) == 64
    assert "versions (packages that can change results)" in text
    assert all((out / f).is_file() for f in ("latency_cdf.png", "bars.png", "mix.png",
                                             "latency_time.png", "run.json", "overhead.csv"))
    # the report is redrawn from the raw records alone, to the same summary
    (out / "summary.json").unlink()
    again = moemesh_process("report", str(out))
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "summary.json").read_text()) == summary


def test_bad_input_is_exit_2_naming_it(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("run", str(QUICKSTART), "--policies", "hetroute,fastest", "--out",
                   str(tmp_path)) == 2
    assert "fastest" in capsys.readouterr().err
    assert moemesh("run", str(tmp_path / "missing.yaml")) == 2
    assert "missing.yaml" in capsys.readouterr().err


FAULTY = Path(__file__).parent / "scenarios" / "faulty.yaml"


@pytest.mark.slow
async def test_faults_happen_and_nothing_is_left_behind(tmp_path: Path) -> None:
    scenario, arms = load_experiment(FAULTY)
    mesh_dir = tmp_path / "mesh"

    def open_mesh(sc: Any, placement: Any) -> Any:  # the nodes' state folders go in mesh_dir
        return open_live(sc, placement, work_dir=mesh_dir)

    meta = await run_experiment(scenario, arms, open_mesh, tmp_path / "out",
                                RunOptions(quality_windows=0, overhead_requests=0, quiet=True,
                                           repeat=2))
    assert meta.repeats == {"n": 2, "orders": [["hetroute"], ["hetroute"]]}
    assert not meta.node_deaths  # a scheduled node-down is a fault, not a death
    for key in ("hetroute", "hetroute#rep1"):  # every repetition has the fault timeline
        events = meta.faults[key]
        assert [(e["action"], e["at_s"]) for e in events] == [
            ("link-down", 1.0), ("node-down", 1.5), ("link-up", 3.0), ("node-up", 3.5)]
        assert all(e["ok"] and e["done_s"] >= e["at_s"] for e in events)
    with (tmp_path / "out" / "tokens.csv").open() as fh:
        reps = Counter((r["policy"], r["rep"]) for r in csv.DictReader(fh))
    assert set(reps) == {("hetroute", "0"), ("hetroute", "1")}
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows, asked, _ = _issued(tmp_path / "out")
    p = summary["policies"]["hetroute"]
    assert p["tokens"] + p["failed_tokens"] == rows["hetroute"] == asked["hetroute"] > 0
    assert len(p["repeats"]["mean_ms"]) == 2 and summary["repeat"] == 2
    assert "node-down edge3" in (tmp_path / "out" / "report.md").read_text()
    _check_fault_effect(tmp_path / "out")
    assert (mesh_dir / "nodes" / "edge3").is_dir()  # the nodes ran with their state here
    assert processes_with(str(mesh_dir)) == []  # and every node process of it is gone


def _check_fault_effect(out: Path) -> None:
    """The faults were felt, not only recorded: while edge1 is cut off from edge2 (1-3 s),
    which alone holds most experts, edge1's tokens are rerouted or fail for want of a
    reachable replica, and nothing fails before the first fault or for another reason."""
    inv = Invariants(budget=1.0)
    felt = 0
    for r in read_rows(out / "tokens.csv", TokenRow):
        inv.check(r)
        if not r.ok and r.sent_s < 1.0 and r.done_s < 1.0:
            raise AssertionError(f"token failed before any fault: {r}")
        if r.home == "edge1" and 1.0 <= r.sent_s < 3.0 and (r.reroutes or not r.ok):
            felt += 1
    assert inv.violations == [], inv.violations[:5]
    assert felt > 0, "the link cut had no visible effect on edge1's tokens"


@pytest.mark.slow
def test_a_sweep_runs_each_point_and_plots_them(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    done = moemesh_process("sweep", str(FAULTY), "--knob", "budget", "--values", "0.5,3",
                           "--requests", "3", "--quality-windows", "0", "--overhead-requests",
                           "0", "--quiet", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["value"], r["policy"]) for r in rows] == [(0.5, "hetroute"), (3.0, "hetroute")]
    for value in ("0.5", "3"):
        point = json.loads((out / f"budget={value}" / "run.json").read_text())
        assert point["quality_budget_pct"] == float(value) and point["faults"]["hetroute"] == []
    assert (out / "sweep_budget.png").read_bytes()[:4] == b"\x89PNG"
    # --resume: the finished point is kept as it is, the missing one runs
    kept = out / "budget=0.5" / "parts" / "hetroute" / "tokens.csv"
    stamp = kept.stat().st_mtime_ns
    shutil.rmtree(out / "budget=3")
    again = moemesh_process("sweep", str(FAULTY), "--knob", "budget", "--values", "0.5,3",
                            "--requests", "3", "--quality-windows", "0", "--overhead-requests",
                            "0", "--quiet", "--out", str(out), "--resume")
    assert again.returncode == 0, again.stdout + again.stderr
    assert kept.stat().st_mtime_ns == stamp
    assert json.loads((out / "budget=3" / "run.json").read_text())["parts"]["state"] == "finished"
    assert [r["value"] for r in json.loads((out / "sweep.json").read_text())["rows"]] == [0.5, 3.0]


@pytest.mark.slow
async def test_a_node_killed_hard_mid_arm_is_named_in_the_verdict_with_its_log(
        tmp_path: Path) -> None:
    """`kill -9` of edge3's node process while the arm runs, with no fault scheduled: the
    supervisor records it (run.json `node_deaths`), keeps its log in the output folder, the
    report's verdict says "not faithful: node died: edge3", and the next repetition finds
    edge3 restarted."""
    import asyncio
    import os
    import signal
    from dataclasses import replace

    scenario, arms = load_experiment(FAULTY)
    wl = replace(scenario.workload, duration_s=8.0, warmup_s=0.0)
    scenario = replace(scenario, faults=(), workload=wl, time_dilation=2.0,
                       auto_dilation=False)
    killed: list[int] = []

    async def kill_later(mesh: Any) -> None:
        await asyncio.sleep(4.0)  # mesh started, placement and reset done: the arm runs
        pid, _ = mesh.launcher.processes()["edge3"]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    @contextlib.asynccontextmanager
    async def open_mesh(sc: Any, placement: Any) -> Any:
        async with open_live(sc, placement, work_dir=tmp_path / "mesh") as mesh:
            task = asyncio.create_task(kill_later(mesh))
            try:
                yield mesh
            finally:
                task.cancel()

    out = tmp_path / "out"
    meta = await run_experiment(scenario, arms, open_mesh, out,
                                RunOptions(quality_windows=0, overhead_requests=0, quiet=True,
                                           repeat=2, link_probe=False))
    assert killed, "the kill never happened"
    (death,) = meta.node_deaths["hetroute"]
    assert death["node"] == "edge3" and death["how"].startswith("exited")
    assert 0 < death["at_s"] < 8.0 and death["log"] == "logs/edge3.log"
    log = (out / "logs" / "edge3.log").read_text()
    assert "edge3" in log and len(log) > 0  # the node's own output, kept
    assert "hetroute#rep1" not in meta.node_deaths  # restarted, and it held
    summary = json.loads((out / "summary.json").read_text())
    assert summary["faithful"] is False
    assert any("not faithful: node died: edge3" in r for r in summary["unfaithful_reasons"])
    text = (out / "report.md").read_text()
    assert "node died: edge3" in text[:text.index("| runtime")]
    assert processes_with(str(tmp_path / "mesh")) == []
