"""The compose generator and the offline-build helpers; no Docker engine needed here.

The files are checked by what they mean (parsed back, merge keys resolved), by the real
`moemesh compose` command line, and by the real scripts (`docker/requirements.py`, the mirror
lookup of `docker/build-base.sh`). The engine-backed checks are in test_compose_run.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from netem.spec import LinkSpec
from orchestrator.compose.file import CONTROLLER, ComposeOptions, compose_data, compose_text
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.topology import Node, Topology
from services.device import DeviceProfile, builtin_profiles, load_profile
from tests.helpers import ROOT

MESH10 = ROOT / "docker" / "scenarios" / "mesh10.yaml"


def topo(*names: str, custom: str | None = None) -> Topology:
    tiny = builtin_profiles()["tiny-edge"]
    odd = DeviceProfile("custom", gpu_tflops=0.02, gpu_mem_gb=0.002, cpu_mem_gb=0.01,
                        h2d_gbps=0.2)
    nodes = [Node(n, odd if n == custom else tiny) for n in names]
    return Topology.build(nodes, default=LinkSpec(delay_ms=2.0, rate_mbit=100.0), name="t")


def resolved(text: str) -> dict:
    """The file as compose reads it: SafeLoader resolves `<<: *node` merge keys."""
    return yaml.safe_load(text)


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`moemesh compose ...` through the real argparse wiring of docker_commands.register."""
    code = ("import argparse, sys\n"
            "from orchestrator.compose import commands as docker_commands\n"
            "p = argparse.ArgumentParser(prog='moemesh')\n"
            "docker_commands.register(p.add_subparsers(dest='command', required=True))\n"
            "a = p.parse_args(sys.argv[1:])\n"
            "try:\n    sys.exit(a.handler(a))\n"
            "except ValueError as e:\n    print(f'moemesh: {e}', file=sys.stderr); sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})


def test_every_node_is_a_service_with_net_admin_health_and_the_token_file() -> None:
    opts = ComposeOptions(scenario_dir="./sc", scenario_file="s.yaml")
    data = resolved(compose_text(topo("edge1", "edge2", "edge3"), opts=opts))
    services = data["services"]
    assert list(services) == ["edge1-host", "edge1", "edge2-host", "edge2", "edge3-host",
                              "edge3", CONTROLLER]
    for name in ("edge1", "edge2", "edge3"):
        s = services[name]
        assert s["cap_add"] == ["NET_ADMIN"] and s["user"] == "root"
        assert s["env_file"] == ["moemesh.env"]
        # in its host's network, which outlives it: a killed node's address refuses at once
        assert s["network_mode"] == f"service:{name}-host" and "networks" not in s
        host = services[f"{name}-host"]
        assert host["networks"] == {"mesh": {"aliases": [name]}}
        assert host["labels"] == {"io.moemesh.role": "host"} and "healthcheck" not in host
        assert s["healthcheck"]["test"][-1] == "/opt/moemesh/healthcheck.py"
        assert s["environment"]["MOEMESH_HOST"] == "0.0.0.0"
        assert s["command"][:4] == ["moemesh", "node", "--name", name]
    ctl = services[CONTROLLER]
    assert ctl["depends_on"] == ["edge1", "edge2", "edge3"]  # the short form Swarm accepts
    assert ctl["command"] == [  # a new folder per up, named by its start (UTC)
        "sh", "-c", "exec moemesh run /scenarios/s.yaml --runtime docker --clock virtual "
        "--out /results/$$(date -u +%Y%m%dT%H%M%SZ)"]
    assert "./results:/results" in ctl["volumes"] and "./sc:/scenarios:ro" in ctl["volumes"]
    assert ctl["environment"]["MOEMESH_DOCKER_ATTACH"] == "1"
    assert data["networks"] == {"mesh": {"internal": True}}  # each engine's default driver
    # virtual time: the controller's clock folder is a tmpfs volume every service mounts
    assert data["volumes"] == {"clock": {"driver_opts": {"type": "tmpfs", "device": "tmpfs"}}}
    for name in ("edge1", "edge2", "edge3", CONTROLLER):
        assert "clock:/run/moemesh/clock" in services[name]["volumes"]
        assert services[name]["environment"]["MOEMESH_CLOCK_DIR"] == "/run/moemesh/clock"


def test_realtime_file_has_no_clock_volume_and_dilates_the_nodes() -> None:
    scenario = load_scenario(ROOT / "docker" / "scenarios" / "ci4.yaml")
    opts = ComposeOptions(scenario_dir="./sc", scenario_file="s.yaml", clock="realtime")
    data = resolved(compose_text(scenario.topology, scenario, opts))
    assert "volumes" not in data
    assert "MOEMESH_CLOCK_DIR" not in data["services"]["edge1"]["environment"]
    # no hosts (Swarm has no network_mode): a killed node's address goes with it
    assert "edge1-host" not in data["services"]
    assert data["services"]["edge1"]["networks"] == ["mesh"]
    assert data["services"]["edge1"]["command"][-2:] == ["--time-dilation", "2"]
    assert "--clock realtime" in data["services"][CONTROLLER]["command"][-1]
    with pytest.raises(ValueError, match="clock 'wall': one of virtual, realtime"):
        ComposeOptions(clock="wall")


def test_swarm_reads_what_compose_reads_elsewhere() -> None:
    """Keys Swarm ignores (restart) have their deploy twin; no node is pinned by default."""
    opts = ComposeOptions(scenario_dir="./sc", scenario_file="s.yaml")
    services = resolved(compose_text(topo("edge1", "edge2"), opts=opts))["services"]
    for name in ("edge1", "edge2", CONTROLLER):
        assert services[name]["restart"] == "no"
        assert services[name]["deploy"]["restart_policy"] == {"condition": "none"}
    assert services["edge1"]["deploy"]["endpoint_mode"] == "dnsrr"  # no IPVS needed
    assert "placement" not in services["edge1"]["deploy"]
    ctl = services[CONTROLLER]
    assert ctl["deploy"]["placement"]["constraints"] == ["node.role == manager"]
    assert ctl["environment"]["MOEMESH_SWARM_SERVICE"] == "{{.Service.Name}}"


def test_a_node_named_like_another_nodes_host_is_refused() -> None:
    opts = ComposeOptions(scenario_dir="./sc", scenario_file="s.yaml")
    with pytest.raises(ValueError, match="edge1-host are taken by the nodes' hosts"):
        compose_text(topo("edge1", "edge1-host"), opts=opts)


def test_a_pinned_node_gets_a_host_label_constraint_and_keeps_the_rest() -> None:
    opts = ComposeOptions(pins={"edge2": "hostb"})
    services = resolved(compose_text(topo("edge1", "edge2"), opts=opts))["services"]
    assert services["edge2"]["deploy"] == {
        "endpoint_mode": "dnsrr", "restart_policy": {"condition": "none"},
        "placement": {"constraints": ["node.labels.moemesh.host == hostb"]}}
    assert "placement" not in services["edge1"]["deploy"]
    with pytest.raises(ValueError, match=r"unknown node.*edge9"):
        compose_data(topo("edge1"), opts=ComposeOptions(pins={"edge9": "a"}))
    with pytest.raises(ValueError, match="host label"):
        ComposeOptions(pins={"edge1": "a b"})


def test_text_and_data_agree_once_merge_keys_are_resolved() -> None:
    t = topo("a1", "a2", custom="a2")
    data = compose_data(t)
    expect = {name: {**svc.pop("<<", {}), **svc} for name, svc in data["services"].items()}
    got = resolved(compose_text(t))
    assert got["services"] == expect
    assert got["x-moemesh-node"] == data["x-moemesh-node"]
    assert "controller" not in got["services"]  # a topology alone: nodes only


def test_a_custom_device_reaches_the_node_as_the_same_profile(tmp_path: Path) -> None:
    t = topo("edge1", "edge2", custom="edge2")
    command = resolved(compose_text(t))["services"]["edge2"]["command"]
    assert command[:2] == ["sh", "-c"]
    script = command[2].replace("/tmp/device.json", str(tmp_path / "device.json"))
    subprocess.run(["sh", "-c", script.split(" && exec ")[0]], check=True, timeout=10)
    assert load_profile(tmp_path / "device.json") == t.node("edge2").device
    assert "--name edge2" in script and "--profile " + str(tmp_path / "device.json") in script


def test_scenario_settings_reach_the_node_command() -> None:
    scenario = load_scenario(ROOT / "docker" / "scenarios" / "ci4.yaml")
    data = resolved(compose_text(scenario.topology, scenario))  # nodes only: the wall clock
    cmd = data["services"]["edge1"]["command"]
    assert cmd == ["moemesh", "node", "--name", "edge1", "--profile", "tiny-edge", "--model",
                   "tiny-moe", "--time-dilation", "2"]
    opts = ComposeOptions(scenario_dir="./sc", scenario_file="ci4.yaml")  # virtual: no dilation
    cmd = resolved(compose_text(scenario.topology, scenario, opts))["services"]["edge1"]["command"]
    assert cmd == ["moemesh", "node", "--name", "edge1", "--profile", "tiny-edge", "--model",
                   "tiny-moe"]


def test_a_node_called_controller_is_refused() -> None:
    with pytest.raises(ValueError, match="'controller' is taken"):
        compose_data(topo("edge1", "controller"))


@pytest.mark.parametrize("field,value,message", [
    ("env_file", "my env", "env file"), ("network", "Mesh!", "network name"),
    ("image", "", "image"),
])
def test_bad_options_name_the_value(field: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ComposeOptions(**{field: value})


def test_compose_yaml_is_what_the_generator_makes_of_mesh10() -> None:
    """compose.yaml is generated (never edited by hand): regenerate it when this fails with
    `moemesh compose docker/scenarios/mesh10.yaml -o compose.yaml`."""
    done = run_cli("compose", "docker/scenarios/mesh10.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.replace("FILE", "compose.yaml") == (ROOT / "compose.yaml").read_text()
    services = resolved(done.stdout)["services"]
    assert len(services) == 21 and CONTROLLER in services  # ten nodes, their hosts


def test_cli_writes_paths_relative_to_the_output_folder(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "mesh.yaml"
    out.parent.mkdir()
    done = run_cli("compose", str(ROOT / "experiments/scenarios/quickstart.yaml"), "-o", str(out),
                   "--image", "moemesh/moemesh:test", "--shaper", "app")
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "5 nodes" in done.stdout
    data = resolved(out.read_text())
    ctl = data["services"][CONTROLLER]
    scen_mount = next(v for v in ctl["volumes"] if v.endswith(":/scenarios:ro"))
    host = scen_mount.split(":")[0]
    assert (out.parent / host / "quickstart.yaml").resolve() == (
        ROOT / "experiments/scenarios/quickstart.yaml").resolve()
    assert (out.parent / ctl["build"]["context"] / "Dockerfile").is_file()
    assert "--clock virtual --shaper app --out" in ctl["command"][-1]
    assert ctl["image"] == "moemesh/moemesh:test"


def test_cli_refuses_a_file_that_is_neither_and_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "odd.yaml"
    bad.write_text("hello: world\n")
    done = run_cli("compose", str(bad))
    assert done.returncode == 2
    assert "odd.yaml" in done.stderr and "neither a scenario" in done.stderr
    missing = run_cli("compose", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_requirements_script_reads_pyproject() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "docker/requirements.py")],
                          capture_output=True, text=True, timeout=30, check=True)
    lines = done.stdout.splitlines()
    assert "torch==2.13.0" in lines
    assert any(line.startswith("aiohttp") for line in lines)
    bad = subprocess.run([sys.executable, str(ROOT / "docker/requirements.py"), "--extra",
                          "nosuch"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "'nosuch'" in bad.stderr


@pytest.mark.parametrize("layout,expect", [
    ({"sources.list.d/debian.sources":
      "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
      "Components: main\n\n# the main archive\nTypes: deb deb-src\n"
      "URIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
      "Components: main\n"}, "http://mirror.example/debian"),
    ({"sources.list": "# comment\ndeb-src http://src.example/debian bookworm main\n"
      "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main\n"},
     "http://one.example/debian"),
])
def test_base_image_mirror_comes_from_apt_sources(tmp_path: Path, layout: dict[str, str],
                                                  expect: str) -> None:
    for rel, text in layout.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    done = subprocess.run(["bash", str(ROOT / "docker/build-base.sh"), "--print-mirror"],
                          capture_output=True, text=True, timeout=30,
                          env={"MOEMESH_APT_ETC": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expect


def test_base_image_without_a_mirror_says_what_to_set(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "docker/build-base.sh"), "--print-mirror"],
                          capture_output=True, text=True, timeout=30,
                          env={"MOEMESH_APT_ETC": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and "MOEMESH_BASE_MIRROR" in done.stderr


def test_dockerfile_installs_dependencies_before_sources() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = text.replace("\\\n", " ").splitlines()  # continuation lines joined
    steps = [line for line in lines if re.match(r"^(FROM|COPY|RUN|USER|HEALTHCHECK)\b", line)]
    first_source = next(i for i, s in enumerate(steps) if s.startswith("COPY moe "))
    deps = next(i for i, s in enumerate(steps) if "install-deps.sh" in s and s.startswith("RUN"))
    assert deps < first_source
    assert steps[0].startswith("FROM ${BASE_IMAGE}")
    assert any(s.startswith("USER moemesh") for s in steps)
    assert any("healthcheck.py" in s for s in steps if s.startswith("HEALTHCHECK"))
    assert 'ARG BASE_IMAGE=python:3.11-slim' in lines
    assert "COPY docker/wheels/ /build/wheels/" in lines  # the offline wheels, deps stage only
