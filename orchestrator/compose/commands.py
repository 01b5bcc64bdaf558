"""`moemesh compose FILE`: a Docker Compose file for any scenario or topology.

    moemesh compose experiments/scenarios/quickstart.yaml > quickstart.compose.yaml
    docker compose -f quickstart.compose.yaml up -d    # then: logs -f controller; down -v
    docker stack deploy -c quickstart.compose.yaml qs  # Swarm, the same file

A scenario gives nodes and a controller that runs it; a bare topology gives nodes only (attach
to them with the docker runtime). Paths in the file (build context, the scenario's folder,
results) are relative to the folder the file is written to: the current one, or --output's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from orchestrator.compose.file import (
    CLOCKS,
    DEFAULT_IMAGE,
    ComposeOptions,
    compose_text,
    scenario_mount,
)
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.scenario import SHAPERS
from orchestrator.scenario.topology import load_topology
from orchestrator.scenario.yamlio import load_yaml
from services.commandline import add_command

__all__ = ["register"]

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "compose", _compose)
    p.add_argument("file", type=Path, help="scenario or topology YAML, e.g. "
                   "experiments/scenarios/quickstart.yaml")
    p.add_argument("-o", "--output", type=Path, help="write here instead of stdout "
                   "(relative paths in the file then start from its folder)")
    p.add_argument("--image", default=DEFAULT_IMAGE, help=f"image of every service "
                   f"(default {DEFAULT_IMAGE})")
    p.add_argument("--env-file", default="moemesh.env", help="file with MOEMESH_TOKEN=..., "
                   "relative to the compose file (default moemesh.env)")
    p.add_argument("--results", default="./results", help="host folder for the controller's "
                   "report (default ./results)")
    p.add_argument("--build-context", help="folder with moemesh's Dockerfile (default: this "
                   "checkout's, when it has one)")
    p.add_argument("--no-build", action="store_true", help="no build section: the image must "
                   "exist already")
    p.add_argument("--shaper", choices=SHAPERS, help="override the scenario's link shaper "
                   "(default: the scenario's own)")
    p.add_argument("--clock", choices=CLOCKS, default="virtual",
                   help="virtual (default): the controller runs the scenario in virtual time and "
                   "the nodes join its clock through a shared volume (one host); realtime: the "
                   "wall clock, dilated by the scenario's factor (Swarm across hosts)")
    p.add_argument("--pin", action="append", default=[], metavar="NODE=HOST",
                   help="Swarm: run NODE only on hosts labelled moemesh.host=HOST (docker node "
                   "update --label-add moemesh.host=HOST NAME); repeat per node")


def _pins(given: list[str]) -> dict[str, str]:
    pins = {}
    for item in given:
        node, sep, host = item.partition("=")
        if not sep or not node or not host:
            raise ValueError(f"--pin {item!r}: write NODE=HOST, e.g. --pin edge1=hosta")
        pins[node] = host
    return pins


def _relative(target: Path, base: Path) -> str:
    rel = os.path.relpath(target.resolve(), base.resolve())
    return rel if rel == "." or os.path.isabs(rel) or rel.startswith("..") else f"./{rel}"


def _compose(args: argparse.Namespace) -> int:
    """print a Docker Compose file for a scenario or topology

    Print a compose file (valid for `docker compose` and `docker-compose -f`) with one service
    per node of FILE's topology and, for a scenario, a controller that runs it against them and
    writes its report to --results.
    """
    path: Path = args.file
    if not path.is_file():
        raise ValueError(f"{path}: no such file (give a scenario or topology YAML)")
    data = load_yaml(path)
    base = (args.output.parent if args.output else Path.cwd())
    if args.output and not base.is_dir():
        raise ValueError(f"--output {args.output}: folder {base} does not exist")
    if isinstance(data, dict) and "topology" in data:
        scenario = load_scenario(path)
        topology = scenario.topology
        scenario_dir, scenario_file = scenario_mount(path, base)
    elif isinstance(data, dict) and "nodes" in data:
        scenario = None
        topology = load_topology(path)
        scenario_dir = scenario_file = None
    else:
        raise ValueError(f"{path}: neither a scenario (it has no `topology`) nor a topology "
                         "(it has no `nodes`)")
    if args.no_build:
        context = None
    elif args.build_context is not None:
        if not (Path(args.build_context) / "Dockerfile").is_file():
            raise ValueError(f"--build-context {args.build_context}: no Dockerfile there")
        context = _relative(Path(args.build_context), base)
    elif (PROJECT_ROOT / "Dockerfile").is_file():
        context = _relative(PROJECT_ROOT, base)
    else:
        context = None
    opts = ComposeOptions(image=args.image, env_file=args.env_file, build_context=context,
                          results=args.results, scenario_dir=scenario_dir,
                          scenario_file=scenario_file, shaper=args.shaper,
                          pins=_pins(args.pin), clock=args.clock)
    text = compose_text(topology, scenario, opts, source=str(path),
                        file_name=args.output.name if args.output else "FILE")
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output} ({len(topology.nodes)} nodes"
              + (", controller" if scenario is not None else "") + ")")
    return 0
