"""One scenario, the same numbers on every runtime: in virtual time the runtime changes where
the nodes live (processes, containers), not the timeline. The docker run's containers join
the controller's clock through a bind mount of its folder (orchestrator/runtimes/docker.py).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker.conftest import leftovers

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "tests" / "docker" / "scenarios" / "same3.yaml"


def run(runtime: str, out: Path, image: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEMESH_IMAGE": image}
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(SCENARIO),
                           "--runtime", runtime, "--out", str(out)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert done.returncode == 0, f"{runtime} run failed: {done.stderr[-3000:]}"


def tokens(folder: Path) -> list[dict[str, str]]:
    """tokens.csv without dense_host_ms (the host's own time, the one column that varies)."""
    with open(folder / "tokens.csv", newline="") as fh:
        return [{k: v for k, v in row.items() if k != "dense_host_ms"}
                for row in csv.DictReader(fh)]


def test_local_and_docker_give_the_same_tokens(image: str, tmp_path: Path) -> None:
    run("docker", tmp_path / "docker", image)
    assert leftovers("io.moemesh.run") == {"containers": "", "networks": "", "volumes": ""}
    run("local", tmp_path / "local", image)
    for side in ("docker", "local"):
        meta = json.loads((tmp_path / side / "run.json").read_text())
        assert (meta["runtime"], meta["clock"]) == (side, "virtual")
    docker, local = tokens(tmp_path / "docker"), tokens(tmp_path / "local")
    assert len(docker) > 20
    assert {r["status"] for r in docker} == {"ok"}
    assert any(r["reroutes"] not in ("", "0") for r in docker)  # the cut link was met
    faults = json.loads((tmp_path / "docker" / "run.json").read_text())["faults"]["hetroute"]
    assert [(f["action"], f["ok"]) for f in faults] == [  # the crash happened mid-run
        ("link-down", True), ("link-up", True), ("node-down", True), ("node-up", True)]
    assert docker == local
