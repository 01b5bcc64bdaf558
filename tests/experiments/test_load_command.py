"""`moemesh load`: a scenario's workload against a mesh that `moemesh up` keeps, with a link
cut by `moemesh fault` during it; the mesh is left up, the rows and summary are written, and
what the mesh as it stands cannot run is refused before anything is sent."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import moemesh, wait_gone
from tests.orchestrator.test_mesh_cli import SCENARIO as MESH_SCENARIO

pytestmark = pytest.mark.slow

SCENARIO = (MESH_SCENARIO.replace("name: meshcli", "name: loadcli")
            .replace("workload: {rate_rps: 1, requests: 2}\n", """\
policies:
  - greedy
  - {policy: greedy, label: greedy-popular, placement: popularity}
workload: {rate_rps: 4, requests: 6, gen_tokens: 4, warmup: 0s}
faults:
  - {at: 0.5s, link-down: [edge1, edge2]}
"""))


def test_a_load_runs_on_the_mesh_up_keeps_and_leaves_it_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "loadcli.yaml"
    scenario.write_text(SCENARIO)
    mesh, out = tmp_path / "mesh", tmp_path / "out"
    where = ["--mesh-dir", str(mesh)]
    assert moemesh("load", str(scenario), *where, "--out", str(out)) == 2
    assert "no mesh is up" in capsys.readouterr().err
    try:
        assert moemesh("up", str(scenario), *where) == 0
        capsys.readouterr()
        assert moemesh("load", str(scenario), *where, "--policy", "greedy-popular",
                       "--out", str(out)) == 2
        assert ("the arm's placement is popularity, the mesh holds hetroute" in
                capsys.readouterr().err)
        assert not out.exists()  # refused before anything was written

        assert moemesh("fault", "link-down", "edge1", "edge2", *where) == 0
        assert moemesh("load", str(scenario), *where, "--out", str(out), "--quiet") == 0
        printed = capsys.readouterr().out
        assert "greedy: 6 requests, " in printed and f"results in {out}" in printed
        rows = list(csv.DictReader((out / "tokens.csv").read_text().splitlines()))
        assert len(rows) == 6 * 4  # every token asked for is a row
        assert {r["policy"] for r in rows} == {"greedy"}
        summary = json.loads((out / "summary.json").read_text())
        assert summary["mesh"] == "loadcli" and summary["clock"] == "realtime"
        assert summary["notes"] == ["the scenario's 1 fault(s) are not applied: inject "
                                    "faults with `moemesh fault`"]
        entry = summary["policies"]["greedy"]
        assert entry["tokens"] + entry["failed_tokens"] == 24
        # the cut link: no token of a request homed on one node ran an expert on the other
        assert all(r["remote_exact"] == "0" for r in rows if r["status"] == "ok")

        assert moemesh("status", *where) == 0  # the load left the mesh up
        assert "link edge1→edge2 down" in capsys.readouterr().out
    finally:
        assert moemesh("down", *where) == 0
    assert wait_gone(str(mesh)) == []
