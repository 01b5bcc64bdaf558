"""`moemesh up|status|down`, `moemesh fault ...` and `moemesh placement`: a mesh by hand.

`up` validates the scenario, starts the mesh supervisor (`orchestrator.mesh.daemon`) in a session of
its own and returns once every node is healthy and configured, printing the endpoints; the
supervisor keeps the mesh until `down`. One mesh per state folder: `--mesh-dir`, else
$MOEMESH_MESH_DIR, else $XDG_RUNTIME_DIR/moemesh, else /tmp/moemesh-<uid>. The folder (mode
0700, owned by this user: checked, so another user cannot plant one) holds a marker
(`netem.markers`: the mesh's id), state.json (endpoints, pids, the mesh token), the
supervisor's and nodes' logs. `down` and the stale clean-up of `up` act only on a folder with
that marker: a folder moemesh did not make is refused, named, and left as it is.

Exit codes: 0 ok, 2 bad input (a bad scenario, an unknown node, a mesh already up), 1 failure.
Link values are ONE-WAY; link faults act on both directions unless `--oneway`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from netem.markers import describe, mark, marker, private_dir, remove_ours, require_ours
from orchestrator.mesh.daemon import (
    LOG_FILE,
    SOCKET_FILE,
    STATE_FILE,
    live_scenario,
    read_state,
    request,
)
from orchestrator.runtimes.local import process_alive
from services.commandline import BadInput

__all__ = ["down_command", "mesh_dir", "ready_state", "register"]

UP_TIMEOUT_S = 600.0
DOWN_TIMEOUT_S = 120.0


def down_command(given: Path | None) -> str:
    """The `moemesh down` a user types to stop this mesh: with the `--mesh-dir` it was given."""
    return "moemesh down" + (f" --mesh-dir {shlex.quote(str(given))}" if given else "")


def mesh_dir(given: Path | None = None) -> Path:
    """Where the mesh's state lives (see the module docstring)."""
    if given is not None:
        return given
    if os.environ.get("MOEMESH_MESH_DIR"):
        return Path(os.environ["MOEMESH_MESH_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "moemesh"
    return Path(f"/tmp/moemesh-{os.getuid()}")


def _with_dir(p: argparse.ArgumentParser, compose: bool = False) -> argparse.ArgumentParser:
    """The flags that find the mesh: --mesh-dir (a mesh `up` keeps), with `compose` also
    --project and --env-file (a compose mesh)."""
    p.add_argument("--mesh-dir", type=Path, default=None,
                   help="state folder of the mesh (default $MOEMESH_MESH_DIR, "
                   "$XDG_RUNTIME_DIR/moemesh or /tmp/moemesh-<uid>)")
    if compose:
        p.add_argument("--project", nargs="?", const="", default=None, metavar="NAME",
                       help="a compose mesh instead: its compose project (alone: this "
                       "folder's, as `docker compose` names it)")
        p.add_argument("--env-file", type=Path, default=Path("moemesh.env"),
                       help="the compose mesh's token file (default moemesh.env; else "
                       "$MOEMESH_TOKEN)")
    return p


def register(sub: argparse._SubParsersAction) -> None:
    up = _with_dir(sub.add_parser("up", help="start a scenario's mesh and keep it running"))
    up.add_argument("scenario", type=Path, help="scenario YAML (e.g. "
                    "experiments/scenarios/quickstart.yaml)")
    up.add_argument("--runtime", choices=("local", "netns", "docker"),
                    help="override the scenario's runtime (e.g. local)")
    up.add_argument("--shaper", choices=("tc", "app", "auto"),
                    help="override the scenario's link shaper (e.g. app)")
    up.add_argument("--policy", help="placement policy (default the scenario's, e.g. hetroute)")
    up.add_argument("--clock", choices=("realtime", "virtual", "auto"),
                    help="a mesh that stays up runs on the wall clock (realtime; auto picks it); "
                         "virtual is refused: `moemesh run` runs a scenario in virtual time")
    up.add_argument("--tdf", type=float, metavar="FACTOR",
                    help="time dilation, e.g. 4 (default: the scenario's time_dilation)")
    up.add_argument("--timeout", type=float, default=UP_TIMEOUT_S,
                    help=f"seconds to wait for a healthy mesh (default {UP_TIMEOUT_S:g})")
    up.set_defaults(handler=_up)

    status = _with_dir(sub.add_parser("status", help="nodes and faulted links of the mesh"),
                      compose=True)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(handler=_status)

    down = _with_dir(sub.add_parser("down", help="stop the mesh; leaves no process behind"))
    down.set_defaults(handler=_down)

    _register_fault(sub)
    _register_placement(sub)


def _register_fault(sub: argparse._SubParsersAction) -> None:
    fault = sub.add_parser("fault", help="inject a fault into the running mesh")
    acts = fault.add_subparsers(dest="fault_action", required=True, metavar="ACTION")
    for action, text in (("link-down", "cut a link (loss 100%%, a blackhole)"),
                         ("link-up", "restore a link to the topology's spec"),
                         ("link-degrade", "change a link's delay, jitter, rate or loss")):
        p = _with_dir(acts.add_parser(action, help=text), compose=True)
        p.add_argument("a", help="one end (e.g. edge1)")
        p.add_argument("b", help="the other end (e.g. edge2)")
        p.add_argument("--oneway", action="store_true", help="only the direction A→B")
        if action != "link-up":
            p.add_argument("--for", dest="for_", metavar="DURATION",
                           help="revert after this long (e.g. 10s)")
        if action == "link-degrade":
            p.add_argument("--delay-ms", help="one-way delay (e.g. 50 or 50ms)")
            p.add_argument("--jitter-ms", help="jitter (e.g. 2ms)")
            p.add_argument("--rate-mbit", help="rate (e.g. 10 or 10mbit)")
            p.add_argument("--loss-pct", help="loss (e.g. 1 or 1%%)")
        p.set_defaults(handler=_fault, fault_args=(action,))
    for action, text in (("node-down", "kill a node's process or container"),
                         ("node-up", "start a killed node again"),
                         ("node-slow", "make a node's compute FACTOR times slower")):
        p = _with_dir(acts.add_parser(action, help=text), compose=True)
        p.add_argument("node", help="node name (e.g. edge3)")
        if action == "node-slow":
            p.add_argument("factor", help="slow-down factor >= 1 (e.g. 3)")
        if action != "node-up":
            p.add_argument("--for", dest="for_", metavar="DURATION",
                           help="revert after this long (e.g. 10s)")
        p.set_defaults(handler=_fault, fault_args=(action,))



def _register_placement(sub: argparse._SubParsersAction) -> None:
    place = sub.add_parser("placement", help="print a scenario's offline placement and cost")
    place.add_argument("scenario", type=Path, help="scenario YAML")
    place.add_argument("--policy", help="hetroute, ordermoe, prism, prism-quant, popularity, "
                       "random, layer-shard or edgeshard (default the scenario's)")
    place.add_argument("--json", action="store_true", help='print {"policy", '
                       '"expected_cost_ms", "local_group_coverage", "nodes", "replicas"}')
    place.add_argument("--tokens", type=int, help="calibration tokens (default 8192 / layers)")
    place.add_argument("--router", default=None,
                       help="routing policy the placement is built for and measured with "
                       "(HetRoute's pruning and GPU residency follow its picks; default: the "
                       "scenario's placement.router, hetroute)")
    place.add_argument("--ilp", action="store_true",
                       help="also solve the exact ILP and report the greedy's gap, and the most "
                       "local group coverage any placement reaches (small instances; text "
                       "output only)")
    place.add_argument("--time-limit", type=float, default=60.0,
                       help="ILP time limit in seconds (default 60)")
    place.set_defaults(handler=_placement)


# ----------------------------------------------------------------------------- up / down


def _alive(state: dict[str, Any]) -> bool:
    sup = state.get("supervisor") or {}
    return bool(sup.get("pid")) and process_alive(int(sup["pid"]), sup.get("start_ticks"))


def _log_tail(folder: Path, lines: int = 15) -> str:
    path = folder / LOG_FILE
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _up(args: argparse.Namespace) -> int:
    from orchestrator.scenario.arms import load_scenario

    loaded = load_scenario(args.scenario)  # a bad file: exit 2 before anything starts
    scenario = live_scenario(loaded, runtime=args.runtime, shaper=args.shaper, clock=args.clock,
                             tdf=args.tdf)
    folder = mesh_dir(args.mesh_dir)
    state = _trusted_state(folder)
    if state is not None and _alive(state):
        raise BadInput(f"a mesh is already up ({state.get('name', '?')}, state {folder}): "
                       f"run `{down_command(args.mesh_dir)}` first")
    if state is not None:
        _clean_stale(folder, state)
    elif folder.exists() and marker(folder) is None and any(folder.iterdir()):
        raise BadInput(f"mesh state folder {folder} was not made by moemesh and is not empty "
                       f"(it holds {describe(folder)}): give an empty or new --mesh-dir")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid == os.getuid():
        os.chmod(folder, 0o700)
    private_dir(folder)
    # what meshd makes there (orchestrator.mesh.daemon): `down` removes these and nothing else
    mark(folder, "mesh", made=(STATE_FILE, f".{STATE_FILE}.tmp", SOCKET_FILE, LOG_FILE, "logs",
                               "work"))
    argv = [sys.executable, "-m", "orchestrator.cli", "meshd", "--detach", "--dir", str(folder),
            "--scenario", str(args.scenario.resolve())]
    for key in ("runtime", "shaper", "policy"):
        if getattr(args, key):
            argv += [f"--{key}", getattr(args, key)]
    if args.tdf is not None:
        argv += ["--tdf", repr(args.tdf)]
    # The supervisor and its nodes import this checkout even where it is not installed.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    spawned = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                             env=env)
    if spawned.returncode != 0 or not spawned.stdout.strip().isdigit():
        raise RuntimeError(f"could not start the mesh supervisor: {spawned.stderr.strip()}")
    pid = int(spawned.stdout.strip())
    try:
        state = _wait_ready(folder, pid, args.timeout)
    except BaseException:
        _stop_supervisor(pid, None)
        _clean_stale(folder, read_state(folder) or {})
        raise
    print(f"mesh {state['name']} up: {len(state['endpoints'])} nodes, runtime "
          f"{state['runtime']}, shaper {state['shaper']}, placement {state['policy']} "
          f"(expected {state['expected_cost_ms']:.4g} ms per token)")
    print(f"  clock realtime, time dilation {scenario.time_dilation:g}"
          + (" (the scenario's clock virtual is for `moemesh run`: a mesh that stays up runs "
             "on the wall clock)" if loaded.virtual else ""))
    procs = state.get("processes") or {}
    for name, ep in state["endpoints"].items():
        pid_text = f"  pid {procs[name][0]}" if name in procs else ""
        print(f"  {name:12s} {ep['url']}{pid_text}")
    if not state.get("router_mounted"):
        print("  (the nodes serve no router: PUT /v1/mesh was skipped)")
    print(f"state in {folder} (token in state.json); stop with: {down_command(args.mesh_dir)}")
    return 0


def _wait_ready(folder: Path, pid: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(folder)
        status = (state or {}).get("status")
        if status == "ready":
            return state
        if status == "failed":
            if state.get("bad_input"):
                raise BadInput(state.get("error", "bad input"))
            raise RuntimeError(f"the mesh did not start: {state.get('error')}\n"
                               f"{_log_tail(folder)}")
        if not process_alive(pid, None):
            raise RuntimeError(f"the mesh supervisor (pid {pid}) exited before the mesh was "
                               f"ready; its log ends with:\n{_log_tail(folder)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the mesh was not ready within {timeout_s:g} s; the "
                               f"supervisor's log ends with:\n{_log_tail(folder)}")
        time.sleep(0.1)


def _stop_supervisor(pid: int, start_ticks: int | None, timeout_s: float = DOWN_TIMEOUT_S
                     ) -> bool:
    """SIGTERM the supervisor (it stops the mesh), SIGKILL if it does not end in time.
    Returns whether it ended by itself."""
    if not process_alive(pid, start_ticks):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(pid, start_ticks):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def _trusted_state(folder: Path) -> dict[str, Any] | None:
    """The mesh's state, read only from a private folder of this user that moemesh marked
    (a state file is a list of process groups to signal: another user's must never be)."""
    if not (folder / STATE_FILE).exists():
        return None
    require_ours(folder, "mesh state folder", "mesh")
    private_dir(folder)
    return read_state(folder)


def _clean_stale(folder: Path, state: dict[str, Any]) -> list[str]:
    """End the node processes a state lists that still run (by pid and start time), then
    remove the folder; only a folder with moemesh's mesh marker (NotOurs otherwise, before
    anything is signalled or deleted). Returns the nodes that had to be ended here."""
    require_ours(folder, "mesh state folder", "mesh")
    ended = []
    for name, (pid, ticks) in (state.get("processes") or {}).items():
        if process_alive(pid, ticks):
            ended.append(name)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)
                for _ in range(50):
                    if not process_alive(pid, ticks):
                        break
                    time.sleep(0.1)
                if not process_alive(pid, ticks):
                    break
    remove_ours(folder, "mesh state folder", "mesh")
    return ended


def _down(args: argparse.Namespace) -> int:
    folder = mesh_dir(args.mesh_dir)
    if not folder.exists():
        print(f"no mesh is up (no state folder {folder})")
        return 0
    require_ours(folder, "mesh state folder", "mesh")  # before anything is read or deleted
    state = _trusted_state(folder)
    if state is None:
        print(f"no mesh is up (state folder {folder}, removed)")
        remove_ours(folder, "mesh state folder", "mesh")
        return 0
    sup = state.get("supervisor") or {}
    clean = True
    if sup.get("pid"):
        clean = _stop_supervisor(int(sup["pid"]), sup.get("start_ticks"))
    leftovers = _clean_stale(folder, state)
    name = state.get("name", "?")
    if leftovers:
        print(f"mesh {name} down; ended leftover node process(es) of "
              f"{', '.join(leftovers)}" + ("" if clean else " (the supervisor was killed)"))
    else:
        print(f"mesh {name} down: {len(state.get('endpoints') or {})} nodes stopped")
    return 0


# ----------------------------------------------------------------------------- status / fault


def ready_state(given: Path | None) -> tuple[Path, dict[str, Any]]:
    """The state folder of the mesh `up` keeps (`--mesh-dir`, else the default) and its state,
    once it is up and ready: BadInput when none is up, RuntimeError when it is stale or not
    ready."""
    folder = mesh_dir(given)
    state = _trusted_state(folder)
    if state is None:
        raise BadInput(f"no mesh is up (state folder {folder}): start one with `moemesh up`")
    if not _alive(state):
        raise RuntimeError(f"the mesh in {folder} is stale (its supervisor is gone): run "
                           f"`{down_command(given)}` to clean up")
    if state.get("status") != "ready":
        raise RuntimeError(f"the mesh is {state.get('status')}, not ready")
    return folder, state


def _ask(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    folder, _ = ready_state(args.mesh_dir)
    answer = asyncio.run(request(folder, payload))
    if not answer.get("ok"):
        if answer.get("bad_input"):
            raise BadInput(answer.get("error", "bad input"))
        raise RuntimeError(answer.get("error", "the supervisor failed"))
    return answer


def _compose_target(args: argparse.Namespace) -> tuple[str, str] | None:
    """(project, token) when the command aims at a compose mesh (--project)."""
    if getattr(args, "project", None) is None:
        return None
    from orchestrator.compose.faults import default_project, read_token

    return args.project or default_project(), read_token(args.env_file)


def _compose_status(project: str, token: str, as_json: bool) -> int:
    from orchestrator.compose.faults import mesh_status

    status = asyncio.run(mesh_status(project, token))
    if as_json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"compose mesh {project}: {len(status['nodes'])} nodes")
    for name, node in status["nodes"].items():
        jobs = f"  {node['jobs']} jobs" if node.get("jobs") is not None else ""
        why = f"  ({node['reason']})" if node.get("reason") else ""
        print(f"  {name:12s} {node['state']:5s} {node['url']}{jobs}{why}")
    if not status["links"]:
        print("links: none faulted from here")
    for link in status["links"]:
        spec = link["spec"]
        print(f"link {link['from']}→{link['to']} {link['state']}: {spec['delay_ms']:g} ms, "
              f"{spec['rate_mbit']:g} Mbit/s, loss {spec['loss_pct']:g}%")
    return 0


def _status(args: argparse.Namespace) -> int:
    compose = _compose_target(args)
    if compose is not None:
        return _compose_status(*compose, args.json)
    status = _ask(args, {"op": "status"})["status"]
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"mesh {status['scenario']}: runtime {status['runtime']}, shaper {status['shaper']}")
    for name, node in status["nodes"].items():
        extra = ""
        if node["state"] == "up":
            extra = f"  queue {node['queue']}, {node['experts']} experts, {node['jobs']} jobs"
        if node.get("slow", 1.0) != 1.0:
            extra += f", slowed x{node['slow']:g}"
        print(f"  {name:12s} {node['state']:11s} {node['url']}{extra}")
    if not status["links"]:
        print("links: all as the topology says")
    for link in status["links"]:
        spec = link["spec"]
        seen = link.get("applied")
        told = "" if not seen else (f" ({link['from']} applies {seen['delay_ms']:g} ms, "
                                    f"{seen['rate_mbit']:g} Mbit/s, loss {seen['loss_pct']:g}%)")
        print(f"link {link['from']}→{link['to']} {link['state']}: {spec['delay_ms']:g} ms, "
              f"{spec['rate_mbit']:g} Mbit/s, loss {spec['loss_pct']:g}%{told}")
    for pending in status.get("pending", []):
        print(f"pending: {pending}")
    return 0


def _fault(args: argparse.Namespace) -> int:
    (action,) = args.fault_args
    target = [args.a, args.b] if action.startswith("link") else [args.node]
    if action == "node-slow":
        target.append(args.factor)
    data: dict[str, Any] = {"at": 0, action: " ".join(target)}
    if getattr(args, "oneway", False):
        data["oneway"] = True
    if getattr(args, "for_", None) is not None:
        data["for"] = args.for_
    for key in ("delay_ms", "jitter_ms", "rate_mbit", "loss_pct"):
        if getattr(args, key, None) is not None:
            data[key] = args.__dict__[key]
    compose = _compose_target(args)
    if compose is not None:
        from orchestrator.compose.faults import apply_fault
        from orchestrator.mesh.faults import fault_from_data
        from orchestrator.scenario.yamlio import Loc

        fault = fault_from_data(data, Loc(None, "fault"))
        print(asyncio.run(apply_fault(compose[0], compose[1], fault)))
        return 0
    answer = _ask(args, {"op": "fault", "fault": data})
    revert = answer.get("revert_in_s")
    print(f"{answer['fault']}: done" + (f"; reverts in {revert:g} s" if revert else ""))
    return 0


# ----------------------------------------------------------------------------- placement


def _placement(args: argparse.Namespace) -> int:
    from orchestrator.placement import place, problem_from_scenario, simulate
    from orchestrator.placement.report import render
    from orchestrator.scenario.arms import load_scenario

    if args.ilp and args.json:
        raise BadInput("--ilp prints a text report; drop --json (the JSON form is exactly "
                       "policy, expected_cost_ms, local_group_coverage, nodes, replicas)")
    if args.tokens is not None and args.tokens < 1:
        raise BadInput(f"--tokens must be >= 1, got {args.tokens}")
    from router.policies import MESH_POLICIES

    if args.router is not None and args.router not in MESH_POLICIES:
        raise BadInput(f"--router: must be one of {', '.join(MESH_POLICIES)}, got "
                       f"{args.router!r}")
    scenario = load_scenario(args.scenario)
    policy = args.policy or scenario.placement.policy
    scenario = replace(scenario, placement=replace(scenario.placement, policy=policy))
    problem = problem_from_scenario(scenario, tokens=args.tokens)
    result = place(problem, policy, router=args.router)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    ilp_result, ilp_cost, coverage = None, None, None
    if args.ilp:
        from orchestrator.placement import ilp

        ilp_result = ilp.solve(problem, time_limit_s=args.time_limit)
        ilp_cost = simulate(problem, ilp_result.replicas,
                            result.notes["router"]).expected_cost_ms
        coverage = ilp.max_coverage(problem, time_limit_s=args.time_limit)
    print(render(result, scenario.name, ilp_result, ilp_cost, coverage))
    return 0
