"""`moemesh doctor`: every optional part named, each missing one with the command that fixes it.

The machine is changed for the checks by PATH (fake `docker`, `docker-compose` scripts, or none
at all) and by the bridge-netfilter switch file; the kernel probe is the real one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import doctor
from tests.helpers import moemesh

PARTS = ("root", "NET_ADMIN", "kernel sch_netem", "ip (iproute2)", "iptables", "Docker engine",
         "image moemesh/moemesh:latest", "Compose v2", "Compose v1", "kmod (modprobe)",
         "UML kernel")


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MOEMESH_IMAGE", raising=False)
    doctor.forget()
    yield
    doctor.forget()  # the rest of the suite sees the real machine again


def fake_bin(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_it_names_every_part_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("doctor") == 0
    out = capsys.readouterr().out
    for part in PARTS:
        assert part in out
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("MISSING"):
            assert lines[i + 1].lstrip().startswith("fix: "), line  # every miss has its fix
    assert "what works here:" in out and "app shaper, local runtime, experiments: yes" in out


def test_an_empty_path_is_each_part_missing_with_its_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    switch = tmp_path / "bridge-nf-call-iptables"
    switch.write_text("1\n")
    monkeypatch.setattr(doctor, "BRIDGE_NF", switch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, iptables, docker, modprobe, apt-get
    found = {c.part: c for c in doctor.checks()}
    assert list(found) == list(PARTS)
    assert found["ip (iproute2)"].fix == "apt-get install -y iproute2"
    assert found["iptables"].fix == "apt-get install -y iptables"
    assert "bridge-nf-call-iptables=1" in found["iptables"].seen
    assert not found["Docker engine"].ok and "docker.io" in found["Docker engine"].fix
    assert not found["image moemesh/moemesh:latest"].ok
    assert found["Compose v2"].fix == "bash docker/install-compose-v2.sh"
    assert found["Compose v1"].fix == "apt-get install -y docker-compose"
    if not Path("/sbin/modprobe").exists():
        assert found["kmod (modprobe)"].fix == "apt-get install -y kmod"
    netns = doctor.feature("netns")
    assert not netns.ok and "iptables: " in netns.reason() and "fix: apt-get" in netns.reason()
    assert moemesh("doctor", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["part"] for c in data["checks"]] == list(PARTS)
    assert data["features"]["netns"]["ok"] is False
    assert "iptables" in data["features"]["netns"]["missing"]


def test_an_engine_with_the_image_and_compose_v2_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_bin(tmp_path, "docker", 'case "$1" in\n'
             '  info) echo 24.0.7 ;;\n'
             '  image) echo sha256:0123456789abcdef0123 ;;\n'
             '  compose) echo "Docker Compose version v2.27.0" ;;\n'
             '  *) exit 1 ;;\n'
             'esac\n')
    fake_bin(tmp_path, "docker-compose", "echo 'no such thing' >&2; exit 3\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MOEMESH_IMAGE", "moemesh/moemesh:test")
    assert doctor.docker_engine() == doctor.Check("Docker engine", True, "answers (server 24.0.7)")
    assert doctor.docker_image().part == "image moemesh/moemesh:test"
    assert doctor.docker_image().ok
    assert doctor.compose("v2").ok and "v2.27.0" in doctor.compose("v2").seen
    v1 = doctor.compose("v1")
    assert not v1.ok and "no such thing" in v1.seen
    assert doctor.feature("docker").ok and doctor.feature("compose-v2").ok
    assert doctor.feature("compose-v1").missing == (v1,)
    with pytest.raises(ValueError, match="unknown feature 'gpu'"):
        doctor.feature("gpu")
