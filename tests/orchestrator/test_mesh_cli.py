"""`moemesh up` → `fault` → `status` → `down` on the local runtime, with real node processes and
the real supervisor; after `down` (or a crash, or a start that times out) nothing is left.
Processes are looked for in /proc by the state folder in their command line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.helpers import moemesh, processes_with, wait_gone

pytestmark = pytest.mark.slow

SCENARIO = """\
name: meshcli
topology:
  nodes:
    - {name: edge1, profile: tiny-edge, users: 2}
    - {name: edge2, profile: tiny-edge, users: 1}
  links:
    - {between: [edge1, edge2], delay_ms: 3ms, rate_mbit: 200mbit}
model: tiny-moe
runtime: local
shaper: app
placement: {policy: hetroute}
workload: {rate_rps: 1, requests: 2}
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "meshcli.yaml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture
def mesh(tmp_path: Path) -> Path:
    """The mesh's state folder (`--mesh-dir`)."""
    return tmp_path / "mesh"


def test_up_fault_status_down_leaves_no_process(
        scenario: Path, mesh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--mesh-dir", str(mesh)]
    try:
        assert moemesh("up", str(scenario), *where) == 0
        out = capsys.readouterr().out
        assert "mesh meshcli up: 2 nodes, runtime local, shaper app" in out
        assert "edge1" in out and "http://127.0.0.1:" in out
        assert "clock realtime, time dilation 1\n" in out  # the scenario names no clock
        assert f"stop with: moemesh down --mesh-dir {mesh}" in out  # the folder it was given
        state = json.loads((mesh / "state.json").read_text())
        assert state["clock"] == "realtime" and state["time_dilation"] == 1
        assert (mesh.stat().st_mode & 0o777) == 0o700
        assert ((mesh / "state.json").stat().st_mode & 0o777) == 0o600  # it holds the token
        pids = [p for p, _ in state["processes"].values()] + [state["supervisor"]["pid"]]
        assert sorted(processes_with(str(mesh))) == sorted(pids)

        assert moemesh("up", str(scenario), *where) == 2
        err = capsys.readouterr().err
        assert "a mesh is already up (meshcli" in err and f"--mesh-dir {mesh}` first" in err

        assert moemesh("fault", "link-down", "edge1", "edge2", "--for", "30s", *where) == 0
        assert "link-down edge1 edge2 (both ways) for 30 s: done; reverts in 30 s" in \
            capsys.readouterr().out
        assert moemesh("fault", "node-slow", "edge2", "2", *where) == 0
        assert moemesh("fault", "node-down", "edge9", *where) == 2
        assert "unknown node 'edge9' (nodes: edge1, edge2)" in capsys.readouterr().err

        assert moemesh("status", "--json", *where) == 0
        status = json.loads(capsys.readouterr().out)
        links = {(lk["from"], lk["to"]): lk for lk in status["links"]}
        assert set(links) == {("edge1", "edge2"), ("edge2", "edge1")}
        for link in links.values():
            assert link["state"] == "down"
            assert link["applied"]["loss_pct"] == 100.0  # as the sending node reports it
        assert status["nodes"]["edge2"]["slow"] == 2.0
        assert all(n["state"] == "up" for n in status["nodes"].values())
        assert status["pending"] == ["link-up edge1 edge2 (both ways) in 30 s"]
        assert moemesh("status", *where) == 0
        text = capsys.readouterr().out
        assert "link edge1→edge2 down" in text and "edge1 applies" in text
    finally:
        assert moemesh("down", *where) == 0
    assert "mesh meshcli down: 2 nodes stopped" in capsys.readouterr().out
    assert wait_gone(str(mesh)) == []
    assert not mesh.exists()
    assert moemesh("status", *where) == 2
    assert "no mesh is up" in capsys.readouterr().err
    assert moemesh("down", *where) == 0


def test_a_crashed_supervisor_takes_its_nodes_and_down_cleans_up(
        scenario: Path, mesh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--mesh-dir", str(mesh)]
    try:
        assert moemesh("up", str(scenario), *where) == 0
        state = json.loads((mesh / "state.json").read_text())
        os.kill(state["supervisor"]["pid"], signal.SIGKILL)
        assert wait_gone(str(mesh)) == []  # the nodes die with it (parent-death signal)
        capsys.readouterr()
        assert moemesh("status", *where) == 1
        assert "is stale (its supervisor is gone)" in capsys.readouterr().err
    finally:
        assert moemesh("down", *where) == 0
    assert not mesh.exists() and processes_with(str(mesh)) == []


def test_bad_input_and_a_start_that_times_out_leave_nothing(
        scenario: Path, mesh: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--mesh-dir", str(mesh)]
    bad = mesh.parent / "bad.yaml"
    bad.write_text(SCENARIO.replace("rate_mbit: 200mbit", "rate_mbit: -5"))
    assert moemesh("up", str(bad), *where) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:7: topology.links[0].rate_mbit: must be > 0" in err and "got -5" in err
    assert not mesh.exists()
    assert moemesh("up", str(scenario), "--shaper", "tc", *where) == 2
    assert "shaper: tc needs the netns or docker runtime" in capsys.readouterr().err
    assert moemesh("up", str(scenario), "--clock", "virtual", *where) == 2
    assert "--clock virtual: a mesh that stays up runs on the wall clock" in \
        capsys.readouterr().err
    assert moemesh("up", str(scenario), "--tdf", "0.5", *where) == 2
    assert "--tdf must be >= 1, got 0.5" in capsys.readouterr().err
    assert not mesh.exists()

    assert moemesh("up", str(scenario), "--timeout", "1", *where) == 1
    assert "the mesh was not ready within 1 s" in capsys.readouterr().err
    assert wait_gone(str(mesh)) == []
    assert not mesh.exists()
