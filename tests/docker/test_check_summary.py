"""docker/check_summary.py, the CI's judge of the compose run, on results written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT


def results(tmp: Path, *, failed: int = 1, rows: int = 5, faults: tuple[str, ...] = (
        "link-down", "node-down"), shaper: str = "app", runtime: str = "docker",
        base: bool = True) -> Path:
    summary = {"scenario": "ci4", "runtime": runtime, "shaper": shaper,
               "policies": {"hetroute": {"tokens": 4, "failed_tokens": failed}},
               "faults": [{"action": a, "at_s": 6.0} for a in faults]}
    (tmp / "summary.json").write_text(json.dumps(summary))
    (tmp / "tokens.csv").write_text("policy,latency_ms\n" + "hetroute,3.0\n" * rows)
    (tmp / "report.md").write_text("# run\n" + ("## Base network\n" if base else ""))
    return tmp


def judge(folder: Path, shaper: str = "app", *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "docker/check_summary.py"), str(folder),
                           "--expect-shaper", shaper, *more], capture_output=True, text=True,
                          timeout=30)


def test_a_complete_run_passes(tmp_path: Path) -> None:
    done = judge(results(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "4 served + 1 failed = 5 tokens" in done.stdout


@pytest.mark.parametrize("change,message", [
    ({"rows": 6}, "4 served + 1 failed != 6 rows"),
    ({"faults": ("link-down",)}, "node-down is not recorded"),
    ({"shaper": "tc"}, "shaper is 'tc', expected 'app'"),
    ({"runtime": "swarm"}, "runtime is 'swarm', expected 'docker'"),
    ({"base": False}, "does not state the measured base network"),
])
def test_each_broken_promise_is_named(tmp_path: Path, change: dict, message: str) -> None:
    done = judge(results(tmp_path, **change))
    assert done.returncode == 1 and message in done.stderr


def test_a_swarm_run_is_judged_as_one(tmp_path: Path) -> None:
    done = judge(results(tmp_path, runtime="swarm"), "app", "--expect-runtime", "swarm")
    assert done.returncode == 0, done.stderr
    assert "runtime swarm" in done.stdout


def test_no_summary_says_so(tmp_path: Path) -> None:
    done = judge(tmp_path)
    assert done.returncode == 1 and "summary.json: missing" in done.stderr
