"""A Docker Compose file for any topology: one service per edge node, plus the controller
(and, in virtual time, one `NAME-host` service per node holding its network: `host_service`).

`compose_text(topology, ...)` writes the file that `moemesh compose SCENARIO > FILE` prints and
that `compose.yaml` (the default ten-node mesh) is made from. One file for three engines, unchanged:
`docker compose` (v2), Debian's `docker-compose -f FILE` (v1, 1.29) and `docker stack deploy -c
FILE` (Swarm). So it holds only their common ground (docs/docker.md has the table of which engine
reads which key): YAML merge keys (`<<: *node`) for what every node shares, `${VAR:-default}`
interpolation, `depends_on` as a plain list (the controller waits for every node's health
itself, with the token), a network with no driver (each engine takes its default: a bridge
under Compose, an overlay under Swarm), and `deploy:` beside `restart:` (Swarm reads the first,
Compose the second).

What each node service gets (docker/README.md): the one image, `cap_add: [NET_ADMIN]` and root (tc
shaping of its own egress needs both; Swarm honours cap_add from Engine and CLI 20.10 on; the node
falls back to the `app` shaper where the kernel lacks sch_netem or the capability), the mesh token
from an env file, a health check on /v1/health, a private network (`internal`: no way out of the
host), a state folder so a restarted container re-applies its links, and under Swarm DNS
round-robin names (`endpoint_mode: dnsrr`: `edge1` and `tasks.edge1` are the task's own address;
no virtual IP, which needs the kernel's IPVS) and optional host pins (`pins`: node -> the value
of the host label `moemesh.host`). The controller runs the scenario attached to these nodes (the
docker runtime under Compose, the swarm runtime under a stack: `MOEMESH_SWARM_SERVICE` is
filled in by Swarm only), kills and revives nodes through the Docker socket, and writes its
report to `./results`; under Swarm it runs on a manager (the service API is there).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from orchestrator.runtimes.docker import HOST_COMMAND, HOST_ROLE
from orchestrator.scenario.scenario import Scenario
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles

__all__ = [
    "CONTROLLER",
    "ComposeOptions",
    "compose_data",
    "compose_text",
    "node_command",
]

CONTROLLER = "controller"  # the controller's service name; no node may be called this
NODE_PORT = 8000
DEFAULT_IMAGE = "moemesh/moemesh:latest"
DEFAULT_BASE = "python:3.11-slim"
SCENARIOS_MOUNT = "/scenarios"
RESULTS_MOUNT = "/results"
RUN_FOLDER = "$$(date -u +%Y%m%dT%H%M%SZ)"  # one folder per run under the results mount
HOST_LABEL = "moemesh.host"  # the Swarm node label a pinned node's constraint matches
# Swarm expands Go templates in a service's environment; Compose leaves the text as it is, so
# the controller tells a stack from a compose project by whether this came back expanded.
SWARM_SERVICE_ENV = "MOEMESH_SWARM_SERVICE"
SWARM_SERVICE_TEMPLATE = "{{.Service.Name}}"
CLOCKS = ("virtual", "realtime")
CLOCK_VOLUME = "clock"  # the run's clock folder, shared by the controller and every node
CLOCK_MOUNT = "/run/moemesh/clock"
CLOCK_DIR_ENV = "MOEMESH_CLOCK_DIR"  # netem.virtual.participant: nodes wait there for it
_NO_RESTART = {"condition": "none"}  # a crashed node stays down until a node-up fault
_ENV_FILE = re.compile(r"^[A-Za-z0-9._/-]+$")


@dataclass(frozen=True)
class ComposeOptions:
    """Knobs of the generated file (defaults: what compose.yaml uses)."""

    image: str = DEFAULT_IMAGE
    env_file: str = "moemesh.env"  # holds MOEMESH_TOKEN=...; relative to the compose file
    build_context: str | None = "."  # where the Dockerfile is; None: no `build:` section
    network: str = "mesh"
    results: str = "./results"  # the controller's output folder on the host
    scenario_dir: str | None = None  # host folder mounted at /scenarios (the scenario's own)
    scenario_file: str | None = None  # the scenario's file name inside scenario_dir
    shaper: str | None = None  # passed to `moemesh run --shaper`; None: the scenario's own
    pins: Mapping[str, str] = field(default_factory=dict)  # node -> host label (Swarm)
    # virtual: the controller runs the scenario in virtual time and the nodes join its clock
    # through the `clock` volume; realtime: the wall clock, dilated by the scenario's factor
    # (Swarm across hosts: one host's clock cannot reach the others, docs/docker.md)
    clock: str = "virtual"

    def __post_init__(self) -> None:
        if not _ENV_FILE.match(self.env_file):
            raise ValueError(f"env file {self.env_file!r}: use a plain relative or absolute "
                             "path (letters, digits, '.', '_', '-', '/')")
        if not re.match(r"^[a-z0-9][a-z0-9_.-]*$", self.network):
            raise ValueError(f"network name {self.network!r}: lower-case letters, digits, "
                             "'_', '.', '-'")
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"image {self.image!r}: give a name like moemesh/moemesh:latest")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock {self.clock!r}: one of {', '.join(CLOCKS)}")
        if (self.scenario_dir is None) != (self.scenario_file is None):
            raise ValueError("scenario_dir and scenario_file go together")
        for node, host in self.pins.items():
            if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", host):
                raise ValueError(f"pin {node}={host!r}: the host label must be letters, digits, "
                                 "'_', '.', '-'")


def _profile_args(node: Node) -> tuple[list[str], str | None]:
    """(`--profile NAME` for a ready profile, or no flag plus the profile as JSON)."""
    if builtin_profiles().get(node.device.name) == node.device:
        return ["--profile", node.device.name], None
    return [], json.dumps(node.device.to_json(), separators=(",", ":"))


def node_command(node: Node, scenario: Scenario | None, *, virtual: bool = False) -> list[str]:
    """The container command of one node (its name, device, model and, on the wall clock,
    time dilation: in virtual time the host's work takes no emulated time)."""
    args = ["moemesh", "node", "--name", node.name]
    profile, custom = _profile_args(node)
    args += profile
    if scenario is not None:
        args += ["--model", scenario.model.name]
        if scenario.model.mode == "modeled":
            args += ["--compute", "modeled"]
        if scenario.time_dilation != 1.0 and not virtual:
            args += ["--time-dilation", f"{scenario.time_dilation:g}"]
    if custom is None:
        return args
    # A device given by numbers: `moemesh node --profile` reads a JSON file, so the command
    # writes one first (single quotes are safe: the JSON holds only a name and numbers).
    if "'" in custom:
        raise ValueError(f"node {node.name}: device profile name must not hold a quote")
    quoted = " ".join(_sh_quote(a) for a in args)
    return ["sh", "-c", f"printf '%s' '{custom}' >/tmp/device.json && exec {quoted} "
                        "--profile /tmp/device.json"]


def _sh_quote(arg: str) -> str:
    return arg if re.match(r"^[A-Za-z0-9._/:=+-]+$", arg) else "'" + arg.replace("'", "") + "'"


def _node_template(opts: ComposeOptions) -> dict[str, Any]:
    template: dict[str, Any] = {"image": opts.image}
    if opts.build_context is not None:
        template["build"] = {"context": opts.build_context,
                             "args": {"BASE_IMAGE": f"${{MOEMESH_BASE_IMAGE:-{DEFAULT_BASE}}}"}}
    template.update({
        "user": "root",  # tc needs NET_ADMIN in the effective set: root's, not the image user's
        "cap_add": ["NET_ADMIN"],
        "env_file": [opts.env_file],
        "environment": {"MOEMESH_HOST": "0.0.0.0", "MOEMESH_PORT": str(NODE_PORT),
                        "MOEMESH_STATE_DIR": "/var/lib/moemesh"},
        "networks": [opts.network],
        # Swarm stops an unhealthy task for good (restart_policy none): ten nodes starting on
        # two cores made 4-s checks time out 3 times in a row, so the margins are wide.
        "healthcheck": {"test": ["CMD", "/opt/moemesh/bin/python", "/opt/moemesh/healthcheck.py"],
                        "interval": "5s", "timeout": "20s", "retries": 6, "start_period": "180s"},
        "restart": "no",  # Compose; Swarm reads deploy.restart_policy
        "stop_grace_period": "10s",
        "deploy": {"endpoint_mode": "dnsrr", "restart_policy": dict(_NO_RESTART)},
    })
    return template


def host_service(node: str) -> str:
    """The service that holds a node's network namespace in a virtual-time file: killing the
    node leaves its address, so peers are refused at once, as on the local runtime
    (orchestrator.runtimes.docker HOST_ROLE)."""
    return f"{node}-host"


def _pinned(template: Mapping[str, Any], host: str) -> dict[str, Any]:
    """The node's own `deploy:` with a placement constraint (a merge key copies whole values,
    so a pinned node repeats the template's deploy keys)."""
    return {**template["deploy"],
            "placement": {"constraints": [f"node.labels.{HOST_LABEL} == {host}"]}}


def compose_data(topology: Topology, scenario: Scenario | None = None,
                 opts: ComposeOptions | None = None) -> dict[str, Any]:
    """The compose file as data, `x-moemesh-node` holding what every node shares.

    `compose_text` writes it with a YAML anchor; here each node service names the template by
    the key `<<` so that `yaml.safe_load(compose_text(...))` equals this with merges resolved.
    """
    opts = opts or ComposeOptions()
    if CONTROLLER in topology.names:
        raise ValueError(f"node name {CONTROLLER!r} is taken by the controller service: rename "
                         "the node")
    unknown = sorted(set(opts.pins) - set(topology.names))
    if unknown:
        raise ValueError(f"pins name unknown node(s) {', '.join(unknown)} (nodes: "
                         f"{', '.join(topology.names)})")
    template = _node_template(opts)
    virtual = opts.scenario_file is not None and opts.clock == "virtual"
    if virtual:  # the nodes wait in the shared folder for the controller's clock
        template["environment"][CLOCK_DIR_ENV] = CLOCK_MOUNT
        template["volumes"] = [f"{CLOCK_VOLUME}:{CLOCK_MOUNT}"]
    services: dict[str, Any] = {}
    if virtual:  # each node in its host's network (HOST_ROLE): a killed node is refused
        del template["networks"]
        taken = sorted({host_service(n) for n in topology.names} & {*topology.names, CONTROLLER})
        if taken:
            raise ValueError(f"service name(s) {', '.join(taken)} are taken by the nodes' hosts "
                             "(NAME-host): rename the node")
    for node in topology.nodes:
        service: dict[str, Any] = {"<<": template,
                                   "command": node_command(node, scenario, virtual=virtual)}
        if virtual:
            host = host_service(node.name)
            services[host] = {
                "image": opts.image, "user": "root", "command": list(HOST_COMMAND),
                "labels": {HOST_ROLE[0]: HOST_ROLE[1]},
                "networks": {opts.network: {"aliases": [node.name]}},
                "restart": "no", "deploy": {"restart_policy": dict(_NO_RESTART)}}
            service["network_mode"] = f"service:{host}"
        services[node.name] = service
        if node.name in opts.pins:
            services[node.name]["deploy"] = _pinned(template, opts.pins[node.name])
    if opts.scenario_file is not None:
        run = ["moemesh", "run", str(PurePosixPath(SCENARIOS_MOUNT, opts.scenario_file)),
               "--runtime", "docker", "--clock", opts.clock]
        if opts.shaper is not None:
            run += ["--shaper", opts.shaper]
        # each `up` writes a new folder, named by the UTC time it started ($$: compose's $)
        command = ["sh", "-c", "exec " + " ".join(run) + f" --out {RESULTS_MOUNT}/{RUN_FOLDER}"]
        controller: dict[str, Any] = {"image": opts.image}
        if opts.build_context is not None:
            controller["build"] = template["build"]
        controller.update({
            "user": "root",  # writes ./results and talks to the Docker socket
            "env_file": [opts.env_file],
            "environment": {"MOEMESH_DOCKER_ATTACH": "1", "MOEMESH_DOCKER_NETWORK": opts.network,
                            SWARM_SERVICE_ENV: SWARM_SERVICE_TEMPLATE,
                            **({CLOCK_DIR_ENV: CLOCK_MOUNT} if virtual else {})},
            "command": command,
            "volumes": [f"{opts.results}:{RESULTS_MOUNT}",
                        f"{opts.scenario_dir}:{SCENARIOS_MOUNT}:ro",
                        "${MOEMESH_DOCKER_SOCK:-/var/run/docker.sock}:/var/run/docker.sock",
                        *([f"{CLOCK_VOLUME}:{CLOCK_MOUNT}"] if virtual else [])],
            "networks": [opts.network],
            "depends_on": list(topology.names),  # start order only: the run waits for health
            "healthcheck": {"disable": True},
            "restart": "no",
            "deploy": {"restart_policy": dict(_NO_RESTART),
                       "placement": {"constraints": ["node.role == manager"]}},
        })
        services[CONTROLLER] = controller
    data = {
        "x-moemesh-node": template,
        "services": services,
        # No driver: Compose makes a bridge, Swarm an overlay. internal: the mesh reaches
        # nothing outside (the host still reaches a bridge).
        "networks": {opts.network: {"internal": True}},
    }
    if virtual:  # in memory, one per host, gone with `down -v`
        data["volumes"] = {CLOCK_VOLUME: {"driver_opts": {"type": "tmpfs", "device": "tmpfs"}}}
    return data


class _Dumper(yaml.SafeDumper):
    """Block style, except short lists of scalars, which read better inline: [NET_ADMIN]."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    short = all(isinstance(v, str | int | float) for v in data) and len(json.dumps(data)) <= 90
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=short)


_Dumper.add_representer(list, _represent_list)


def _dump(data: Any, indent: int) -> str:
    text = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    pad = " " * indent
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def compose_text(topology: Topology, scenario: Scenario | None = None,
                 opts: ComposeOptions | None = None, *, source: str = "",
                 file_name: str = "FILE") -> str:
    """The compose file: a comment header, the shared node template, then the services."""
    opts = opts or ComposeOptions()
    data = compose_data(topology, scenario, opts)
    what = f"scenario {scenario.name}" if scenario is not None else f"topology {topology.name}"
    head = [
        f"# moemesh: {what}, {len(topology.nodes)} edge nodes"
        + (" and a controller" if CONTROLLER in data["services"] else "")
        + (f" (from {source})" if source else ""),
        "# Generated by `moemesh compose`; the same file for `docker compose` (v2),",
        "# `docker-compose -f` (v1) and `docker stack deploy -c` (Swarm). Needs the image",
        "# (docker/README.md), the token file and the results folder (Swarm makes no bind source):",
        f"#   printf 'MOEMESH_TOKEN=%s\\n' \"$(openssl rand -hex 16)\" > {opts.env_file}",
    ]
    if CONTROLLER in data["services"]:
        virtual = "volumes" in data
        head += [f"#   mkdir -p {opts.results}",
                 f"#   docker compose -f {file_name} up -d      # the controller waits until "
                 "every node is healthy;",
                 f"#       each up writes a new report folder in {opts.results} (UTC start time)",
                 f"#   docker compose -f {file_name} logs -f controller",
                 f"#   docker compose -f {file_name} down -v"]
        if virtual:
            head += ["# Clock: virtual (the controller's clock reaches the nodes through the "
                     f"`{CLOCK_VOLUME}` volume; one host).",
                     "# Each node runs in the network of its NAME-host service, which outlives "
                     "it: a killed", "# node's address refuses connections, as a crashed "
                     "server's host does.",
                     "# Swarm (nodes on several hosts): make the file with `moemesh compose "
                     "--clock realtime`."]
        else:
            head += [f"#   docker stack deploy -c {file_name} mm   # Swarm: docker service "
                     "logs -f mm_controller; docker stack rm mm",
                     "# Clock: realtime (the wall clock, dilated by the scenario's factor)."]
    else:
        head += [f"#   docker compose -f {file_name} up -d; ...; docker compose -f {file_name} "
                 "down -v", f"#   docker stack deploy -c {file_name} mm; ...; docker stack rm mm"]
    head += ["# Link shaping is applied at run time through each node's control plane (one-way "
             "links);", "# nodes shape with tc where the kernel has sch_netem, else `app`."]
    out = ["\n".join(head), "", "x-moemesh-node: &node", _dump(data["x-moemesh-node"], 2).rstrip(),
           "", "services:"]
    for name, service in data["services"].items():
        body = {k: v for k, v in service.items() if k != "<<"}
        out.append(f"  {name}:")
        if "<<" in service:
            out.append("    <<: *node")
        out.append(_dump(body, 4).rstrip())
    out += ["", "networks:", _dump(data["networks"], 2).rstrip()]
    if "volumes" in data:
        out += ["", "volumes:", _dump(data["volumes"], 2).rstrip()]
    out.append("")
    return "\n".join(out)


def scenario_mount(path: Path, compose_dir: Path | None = None) -> tuple[str, str]:
    """(host folder to mount at /scenarios, file name) for a scenario file.

    The folder is written relative to the compose file's folder (default: the current one),
    as `./...`, so the file keeps working when the project folder moves.
    """
    folder = path.resolve().parent
    base = (compose_dir or Path.cwd()).resolve()
    try:
        rel = os.path.relpath(folder, base)
    except ValueError:  # another drive (Windows)
        rel = str(folder)
    host = rel if os.path.isabs(rel) or rel.startswith("..") else f"./{rel}"
    return (host.rstrip("/") if host != "./." else ".", path.name)
