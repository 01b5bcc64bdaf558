"""The Mahimahi scenario end to end: trace-driven links with both backends (issue 15).

`app` runs on this host (local runtime); `tc` runs inside the kernel lab (netns runtime, real
qdiscs whose rate follows the traces by in-place changes). Both are slow: they start a
three-node tiny-moe mesh (`--run-slow`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "experiments" / "scenarios" / "mahimahi.yaml"


# In the UML guest a tiny-moe node needs ~15 s to import torch, and three starting at once on
# its one CPU outlast the netns runtime's 30 s start timeout, which `moemesh run` offers no
# option for: the lab run raises that default (only that) in the CLI's own process.
LONG_START = ("import sys; import orchestrator.runtimes.netns as netns; "
              "netns.NetnsRuntime.__init__.__kwdefaults__['ready_timeout_s'] = 300.0; "
              "from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))")


def run_scenario(out: Path, *flags: str, timeout_s: float, slow_start: bool = False) -> dict:
    return run_scenario_file(SCENARIO, out, *flags, timeout_s=timeout_s, slow_start=slow_start)


def run_scenario_file(path: Path, out: Path, *flags: str, timeout_s: float,
                      slow_start: bool = False) -> dict:
    """`moemesh run PATH --out OUT --quiet FLAGS` in a child; its summary and run.json."""
    cli = ["-c", LONG_START] if slow_start else ["-m", "orchestrator.cli"]
    proc = subprocess.run([sys.executable, *cli, "run", str(path),
                           "--out", str(out), "--quiet", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    run = json.loads((out / "run.json").read_text())
    return {"summary": summary, "run": run}


def check(result: dict, shaper: str) -> None:
    summary = result["summary"]
    assert summary["shaper"] == shaper
    for name in ("local-first", "hetroute"):
        policy = summary["policies"][name]
        assert policy["tokens"] > 0, (name, policy)
        assert policy["failed_tokens"] <= policy["tokens"] // 10, (name, policy)
    links = result["run"]["scenario_data"]["topology"]["links"]
    assert any("schedule" in link for link in links)


@pytest.mark.slow
def test_mahimahi_scenario_with_the_app_backend(tmp_path: Path) -> None:
    check(run_scenario(tmp_path / "app", "--shaper", "app", timeout_s=600), "app")


@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.timeout(1500)
def test_mahimahi_scenario_with_tc_in_namespaces(tmp_path: Path) -> None:
    """About 2 minutes in the lab, in a guest of 3 GiB (`moemesh lab run --mem 3072`: in the
    default 768 MiB the three tiny-moe nodes never finish starting); .ci/lab.sh runs it only
    with MOEMESH_LAB_E2E=1. Quality scoring is left out (--quality-windows 0): it says nothing
    about the links."""
    check(run_scenario(tmp_path / "tc", "--runtime", "netns", "--shaper", "tc",
                       "--quality-windows", "0", timeout_s=1400, slow_start=True), "tc")
