"""A two-host rehearsal on one machine: two compose networks, one per "site", joined only by a
router container whose egress is rate-limited with tbf (the real link between the hosts),
with a generated compose file and its own controller running a short experiment over both.

What it shows: the nodes shape only their own egress, so the emulated links stack on the
network that joins the sites, and the run's base-network probe (experiments.analysis.fidelity,
probe_base) sees that network as it is: a cross-site pair's base goodput is the join's rate,
a same-site pair's is far above it, and report.md says how the base meets the emulated delay.
The sites are made unreachable from each other except through the join: Docker isolates two
bridges, and each node's route to the other site's subnet goes via the join (set in the
node's entrypoint, so a route that failed to apply fails the node, not the assertion).

The kernel here has no sch_netem in containers, so the join limits the rate only (tbf), not
the delay; on real hosts the wire adds both (docs/docker.md, Real hosts).
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from netem.spec import LinkSpec
from orchestrator.compose.file import ComposeOptions, compose_text
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles
from tests.docker.conftest import docker_cli, leftovers
from tests.helpers.machine import require_compose

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SITES = {"site_a": ("10.231.1", ("a1", "a2")), "site_b": ("10.231.2", ("b1", "b2"))}
JOIN_MBIT = 20  # the join's tbf rate, each direction
# A same-site pair is this many times faster than the join at least. The bridge itself is far
# faster, but the probe's wall-clock times carry the nodes' Python and HTTP work: on a busy
# 2-core CI host a same-site exchange of 400 kB took 15.7 and 25.6 ms, where the join needs
# 154 ms at the least (the bound was a tenth, 15.4 ms, until 2026-12-05).
SEPARATION = 4
SCENARIO = """\
name: two-sites
topology:
  name: two-sites
  nodes:
    - {name: a1, profile: tiny-edge, users: 1}
    - {name: a2, profile: tiny-edge, users: 1}
    - {name: b1, profile: tiny-edge, users: 1}
    - {name: b2, profile: tiny-edge, users: 1}
  defaults: {delay_ms: 2.0, rate_mbit: 400}
model: tiny-moe
runtime: docker
shaper: app
time_dilation: 2.0
placement: {policy: layer-shard, redundancy: 1.0, variants: [fp16]}
policies: [greedy]
workload: {arrival: poisson, rate_rps: 1.0, home: users, prompt_tokens: [8, 12], gen_tokens: 4,
           duration: 6s, warmup: 1s, seed: 5}
"""


def topology() -> Topology:
    tiny = builtin_profiles()["tiny-edge"]
    names = [n for _, (_, nodes) in SITES.items() for n in nodes]
    return Topology.build([Node(n, tiny) for n in names],
                          default=LinkSpec(delay_ms=2.0, rate_mbit=200.0), name="two-sites")


def two_site_file(text: str, image: str) -> dict[str, Any]:
    """The generated one-network file, made into two sites joined by a shaped router ($$:
    compose would expand a single $ itself)."""
    data = yaml.safe_load(text)
    del data["networks"]["mesh"]
    join_cmd = ["set -e"]
    for net, (prefix, nodes) in SITES.items():
        data["networks"][net] = {"ipam": {"config": [{"subnet": f"{prefix}.0/24"}]}}
        other = next(p for n, (p, _) in SITES.items() if n != net)
        for name in nodes:
            svc = data["services"][name]
            # the node's network is its host's (virtual-time files: a NAME-host service)
            data["services"].get(f"{name}-host", svc)["networks"] = {net: {"aliases": [name]}}
            # the only way to the other site: this site's side of the join
            svc["entrypoint"] = ["sh", "-c", f'ip route add {other}.0/24 via {prefix}.254 '
                                 '&& exec "$$@"', "sh"]
        join_cmd.append(f"dev=$$(ip -o -4 addr | awk '/ {prefix}\\./ {{print $$2}}')")
        join_cmd.append(f"tc qdisc add dev $$dev root tbf rate {JOIN_MBIT}mbit burst 10kb "
                        "latency 400ms")
    join_cmd.append("touch /tmp/shaped && exec sleep infinity")
    data["services"]["join"] = {
        "image": image, "user": "root", "cap_add": ["NET_ADMIN"],
        "sysctls": {"net.ipv4.ip_forward": 1},
        "networks": {net: {"ipv4_address": f"{prefix}.254"}
                     for net, (prefix, _) in SITES.items()},
        "entrypoint": ["sh", "-c", "\n".join(join_cmd)],
        "healthcheck": {"test": ["CMD", "test", "-e", "/tmp/shaped"], "interval": "1s",
                        "retries": 30},
    }
    ctl = data["services"]["controller"]
    ctl["networks"] = list(SITES)  # the control plane reaches both sites directly
    ctl["environment"].pop("MOEMESH_DOCKER_NETWORK")  # each node's only network
    ctl["command"] += ["--quality-windows", "0"]
    ctl["depends_on"] = {"join": {"condition": "service_healthy"},
                         **{n: {"condition": "service_started"}
                            for _, (_, nodes) in SITES.items() for n in nodes}}
    return data


def compose(project: str, file: Path, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(["docker", "compose", "-p", project, "-f", str(file), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=file.parent)
    if done.returncode != 0:
        logs = subprocess.run(["docker", "compose", "-p", project, "-f", str(file), "logs",
                               "--tail", "15"], capture_output=True, text=True, timeout=60,
                              cwd=file.parent).stdout
        raise AssertionError(f"docker compose {' '.join(args)}: {done.stderr[-1500:]}\n{logs}")
    return done.stdout


def test_two_sites_joined_by_a_shaped_link_show_in_the_base_network(image: str,
                                                                    tmp_path: Path) -> None:
    require_compose("v2")
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "two-sites.yaml").write_text(SCENARIO)
    (tmp_path / "results").mkdir()
    (tmp_path / "moemesh.env").write_text(f"MOEMESH_TOKEN={secrets.token_hex(8)}\n")
    text = compose_text(topology(), opts=ComposeOptions(
        image=image, build_context=None, scenario_dir="./scenarios",
        scenario_file="two-sites.yaml", clock="realtime"))  # the probe reads the real wire
    file = tmp_path / "compose.yaml"
    file.write_text(yaml.safe_dump(two_site_file(text, image), sort_keys=False))
    project = f"mmsites{secrets.token_hex(3)}"
    try:
        compose(project, file, "up", "-d")
        ctl = compose(project, file, "ps", "-q", "controller").strip()
        code = docker_cli("wait", ctl, timeout=600)
        log = docker_cli("logs", "--tail", "40", ctl, check=False)
        assert code == "0", f"the controller exited {code}:\n{log}"
    finally:
        compose(project, file, "down", "-v", "--remove-orphans", "-t", "5")
    assert leftovers(f"com.docker.compose.project={project}") == {
        "containers": "", "networks": "", "volumes": ""}

    (folder,) = (tmp_path / "results").iterdir()  # each up writes a folder of its own
    run = json.loads((folder / "run.json").read_text())
    base = run["fidelity"]["base"]
    cross = {k: v for k, v in base.items() if k[0] != k.split("-")[1][0]}
    same = {k: v for k, v in base.items() if k not in cross}
    assert sorted(cross) == ["a1-b1", "a1-b2", "a2-b1", "a2-b2"] and len(same) == 2, base
    # Physics first: a large probe message and its answer cannot cross the join faster than
    # its rate allows (less the two 10 kB bursts), and on one bridge they take far less.
    bound_ms = {k: (v["d_out"] + v["d_in"] - 20e3) * 8 / (JOIN_MBIT * 1e3)
                for k, v in base.items()}
    for key, fit in cross.items():
        assert fit["link_large_ms"] >= bound_ms[key], (key, fit)
    for key, fit in same.items():
        assert fit["link_large_ms"] < bound_ms[key] / SEPARATION, (key, fit)
    # The reported goodput names the join: its rate, less HTTP and TCP overheads (the fit also
    # carries the small messages' noise, hence the median over the four cross pairs).
    rates = sorted(v["rate_mbit"] for v in cross.values())
    assert 0.4 * JOIN_MBIT < (rates[1] + rates[2]) / 2 < 1.3 * JOIN_MBIT, rates
    for key, fit in same.items():
        assert fit.get("rate_mbit") is None or fit["rate_mbit"] > SEPARATION * JOIN_MBIT, (
            key, fit)
    assert run["fidelity"]["combine"] == "absorbed"  # the app shaper's rule, stated
    report = (folder / "report.md").read_text()
    assert "## Base network" in report and "absorbed" in report
    assert all(pair in report for pair in cross)
