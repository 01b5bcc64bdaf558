"""`moemesh lab probe`, `moemesh bench links` and the `bench` group, as a user runs them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from bench.links import judge, main, wilson
from netem.commands import register
from tests.helpers import ROOT, env


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "netem.lab", *args], capture_output=True,
                          text=True, env=env(), cwd=ROOT, timeout=120)


@pytest.mark.netns(bridge=False)  # the tc probe tries netem in a scratch namespace
def test_lab_probe_says_which_backends_work_and_why() -> None:
    done = _run("probe", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"tc", "app", "auto", "lab"}
    assert report["app"]["ok"] is True
    assert report["auto"] == ("tc" if report["tc"]["ok"] else "app")
    assert report["tc"]["reason"]  # in words, either way
    text = _run("probe")
    assert "auto picks:" in text.stdout


def test_bad_grid_input_is_exit_code_2_naming_the_value() -> None:
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "lab", "bench-links",
                           "--delays", "1,fast"], capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "expected numbers separated by commas, got '1,fast'" in done.stderr
    done = _run("run", "--timeout", "soon")
    assert done.returncode == 2 and "invalid float value: 'soon'" in done.stderr


def test_bench_links_app_prints_the_issue_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--backend", "app", "--json", "--delays", "5", "--rates", "100", "--losses",
               "0", "--samples", "10", "--seconds", "0.3"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "app" and isinstance(doc["overhead_ms"], float)
    (row,) = doc["rows"]
    assert row["configured"] == {"delay_ms": 5.0, "rate_mbit": 100.0, "loss_pct": 0.0}
    assert set(row["measured"]) == {"delay_ms", "rate_mbit", "loss_pct"}
    assert row["measured"]["delay_ms"] >= 4.9  # never early: sleeping is deadline-based
    assert row["measured"]["rate_mbit"] == pytest.approx(100, rel=0.2)


def test_bench_registers_its_targets_and_the_lab_grid() -> None:
    from bench.commands import register as register_bench

    parser = argparse.ArgumentParser(prog="moemesh")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    register_bench(sub)
    assert parser.parse_args(["bench", "links", "--rates", "10"]).rates == (10.0,)
    assert parser.parse_args(["bench", "node"]).bench_target == "node"
    lab = parser.parse_args(["lab", "bench-links"])
    assert lab.burst_ms == 20.0  # the lab's late timers need a deeper HTB burst
    assert parser.parse_args(["lab", "run", "--", "-k", "rate"]).pytest_args == ["--", "-k",
                                                                                 "rate"]


def test_judging_follows_the_issue_targets() -> None:
    row = {"configured": {"delay_ms": 20.0, "rate_mbit": 100.0, "loss_pct": 1.0},
           "measured": {"delay_ms": 20.35, "rate_mbit": 97.5, "loss_pct": 1.2},
           "loss_count": [24, 2000], "offered_mbit": None}
    verdict = judge(row)
    assert verdict["delay_ok"] is True  # 0.35 ms <= 2% of 20 ms = 0.4 ms
    assert verdict["rate_ok"] is True and verdict["loss_ok"] is True
    row["measured"]["rate_mbit"] = 90.0
    assert judge(row)["rate_ok"] is False
    assert judge(row, capacity_mbit=100.0)["rate_ok"] is None  # the path, not the link
    lo, hi = wilson(20, 2000)
    assert lo < 1.0 < hi and hi - lo < 1.0


def test_no_package_below_bench_imports_it() -> None:
    """bench sits at the top beside the CLI: it registers its own commands (issue 40)."""
    import re

    pattern = re.compile(r"^\s*(from bench[ .]|import bench\b)", re.M)
    lower = [p for pkg in ("moe", "services", "netem", "router", "orchestrator", "experiments")
             for p in (ROOT / pkg).rglob("*.py") if pattern.search(p.read_text())]
    assert lower == []
