"""A run killed with SIGKILL loses only the policy in flight, and `--resume` finishes it.

Real processes: `moemesh run` as a child (the `local` runtime, real node processes on
loopback), killed with `kill -9` as soon as its first policy's part is on disk
(experiments.run.parts: the test waits for that file, it does not sleep), then resumed, and
compared with an uninterrupted run of the same scenario.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from experiments.run.rows import RequestRow, TokenRow, read_rows
from tests.helpers import ROOT, env, moemesh_process, processes_with

SCENARIO = Path(__file__).parent / "scenarios" / "three-arms.yaml"
POLICIES = ["hetroute", "greedy", "local-first"]
FLAGS = ["--quality-windows", "1", "--tdf", "2", "--quiet"]
# what the seeded plan decides about a request (not what the mesh measured)
PLANNED = ("policy", "request", "home", "user", "warmup", "at_s", "prompt_tokens",
           "gen_tokens", "rep")


def _done(out: Path) -> list[str]:
    try:
        return json.loads((out / "run.json").read_text())["parts"]["done"]
    except (OSError, ValueError, KeyError):  # not there yet (run.json is replaced whole)
        return []


def _kill_after_first_part(out: Path, tmp: Path) -> None:
    """Start `moemesh run`, SIGKILL it once run.json says hetroute is done, reap what it
    left."""
    child_env = env(TMPDIR=str(tmp))  # every node's files (and command line) under tmp
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", str(SCENARIO),
                             *FLAGS, "--out", str(out)], cwd=ROOT, env=child_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while "hetroute" not in _done(out):
            assert proc.poll() is None, f"the run ended early: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "the first policy never finished"
            time.sleep(0.05)  # polling for what the run writes: an event, not a guess
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()
    # the orphaned node processes (a SIGKILL leaves them; their command lines name tmp)
    for pid in processes_with(str(tmp)):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while processes_with(str(tmp)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _planned(folder: Path) -> list[tuple]:
    rows = read_rows(folder / "requests.csv", RequestRow)
    return sorted(tuple(getattr(r, k) for k in PLANNED) for r in rows)


@pytest.mark.slow
def test_a_killed_run_keeps_its_first_policy_and_resumes_to_the_same_summary(
        tmp_path: Path) -> None:
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    _kill_after_first_part(out, tmp)

    # the finished policy is on disk whole: every token its requests asked for, parseable
    tokens = list(read_rows(out / "tokens.csv", TokenRow))
    requests = list(read_rows(out / "requests.csv", RequestRow))
    assert {t.policy for t in tokens} == {r.policy for r in requests} == {"hetroute"}
    assert len(tokens) == sum(r.gen_tokens for r in requests) > 0
    assert len(requests) == 8
    meta = json.loads((out / "run.json").read_text())
    assert meta["parts"]["state"] == "running" and meta["parts"]["done"] == ["hetroute"]
    assert "hetroute" in meta["quality"]

    # a report from the partial folder says what is missing and why
    drawn = moemesh_process("report", str(out))
    assert drawn.returncode == 0, drawn.stderr
    partial = json.loads((out / "summary.json").read_text())
    assert list(partial["policies"]) == ["hetroute"]
    assert set(partial["missing"]) == {"greedy", "local-first"}
    assert all("stopped" in why for why in partial["missing"].values())
    assert "Partial run: 2 part(s) missing" in (out / "report.md").read_text()

    # refused when the scenario differs (here: one request fewer), naming it
    wrong = moemesh_process("run", str(SCENARIO), *FLAGS, "--requests", "7",
                            "--resume", str(out))
    assert wrong.returncode == 2 and "scenario differs" in wrong.stderr, wrong.stderr
    assert "workload" in wrong.stderr
    # ... and when the code's commit differs
    other = tmp_path / "other"
    shutil.copytree(out, other)
    data = json.loads((other / "run.json").read_text())
    data["host"]["commit"] = "0000000"
    (other / "run.json").write_text(json.dumps(data))
    wrong = moemesh_process("run", "--resume", str(other))
    assert wrong.returncode == 2 and "commit differs" in wrong.stderr, wrong.stderr

    first = (out / "parts" / "hetroute" / "tokens.csv").read_bytes()
    resumed = moemesh_process("run", "--resume", str(out), extra_env={"TMPDIR": str(tmp)})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (out / "parts" / "hetroute" / "tokens.csv").read_bytes() == first  # not rerun
    meta = json.loads((out / "run.json").read_text())
    assert meta["parts"]["state"] == "finished"
    assert meta["resumed"][0]["kept"] == ["hetroute"]
    assert not list((out / "parts").glob(".*"))  # the killed part's leftovers are gone

    full = tmp_path / "full"
    done = moemesh_process("run", str(SCENARIO), *FLAGS, "--out", str(full))
    assert done.returncode == 0, done.stdout + done.stderr
    a = json.loads((out / "summary.json").read_text())
    b = json.loads((full / "summary.json").read_text())
    assert "missing" not in a and list(a["policies"]) == list(b["policies"]) == POLICIES
    for key in ("scenario", "runtime", "shaper", "model", "seed", "time_dilation", "repeat"):
        assert a[key] == b[key], key
    for name in POLICIES:  # the same plan and seeds: the same tokens asked for and done
        pa, pb = a["policies"][name], b["policies"][name]
        assert (pa["tokens"], pa["failed_tokens"]) == (pb["tokens"], pb["failed_tokens"])
    assert _planned(out) == _planned(full)
    with (out / "tokens.csv").open() as fh:
        got = Counter(r["policy"] for r in csv.DictReader(fh))
    assert list(got) == POLICIES  # rows in run order, each policy once
    assert processes_with(str(tmp)) == []
