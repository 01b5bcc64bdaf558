"""The mesh supervisor: one process that owns a mesh between `moemesh up` and `moemesh down`.

`moemesh up` starts `moemesh meshd --dir DIR --scenario FILE ...` in a session
of its own and returns once DIR/state.json says `ready` (or `failed`). The supervisor holds the
`LiveMesh` (so the runtime that created nodes, namespaces or containers is the one that removes
them), answers the CLI on a Unix socket (DIR/control.sock, one JSON line in, one out) and stops
the mesh on SIGTERM or SIGINT, on a `down` request, or when its own start fails; the state file
then goes too. A state file whose supervisor is gone is stale: `moemesh down` then ends the node
processes it lists itself (by pid and start time, never by name).

Requests: {"op": "status"}, {"op": "fault", "fault": {"at": 0, "link-down": "a b", "for": 10}}
(the YAML fault form; `for` schedules the revert), {"op": "down"}. Answers: {"ok": true, ...}
or {"ok": false, "error": TEXT, "bad_input": BOOL}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.mesh.lifetime import to_the_end
from services.commandline import add_command

__all__ = ["SOCKET_FILE", "STATE_FILE", "live_scenario", "make_runtime", "read_state", "register",
           "request", "write_state"]

STATE_FILE = "state.json"
SOCKET_FILE = "control.sock"
LOG_FILE = "meshd.log"


def write_state(folder: Path, state: dict[str, Any]) -> None:
    """Replace the state file atomically, readable by this user only (it holds the token)."""
    tmp = folder / f".{STATE_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh, indent=1)
    os.replace(tmp, folder / STATE_FILE)


def read_state(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise RuntimeError(f"mesh state file {folder / STATE_FILE} is corrupt: {exc}") from None


async def request(folder: Path, payload: dict[str, Any], timeout_s: float = 300.0
                  ) -> dict[str, Any]:
    """One request to the supervisor of the mesh in `folder`."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_unix_connection(str(folder / SOCKET_FILE))
        try:
            writer.write(json.dumps(payload).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    if not line:
        raise RuntimeError("the mesh supervisor closed the connection without an answer")
    return json.loads(line)


class Supervisor:
    """What the supervisor holds: the mesh, the state it writes, the pending reverts."""

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        self.folder = folder
        self.args = args
        self.stop = asyncio.Event()
        self.state: dict[str, Any] = {}
        self.mesh: Any = None
        self.pending: set[asyncio.Task[Any]] = set()  # reverts of faults given `--for`
        self.reverts: asyncio.TaskGroup | None = None  # owns them while the mesh serves
        self.history: list[dict[str, Any]] = []

    def save(self, **changes: Any) -> None:
        self.state.update(changes)
        write_state(self.folder, self.state)


def live_scenario(scenario: Any, *, runtime: str | None = None, shaper: str | None = None,
                  clock: str | None = None, tdf: float | None = None) -> Any:
    """The scenario as a mesh that stays up runs it: on the wall clock, dilated by `tdf` (else
    the scenario's factor). Virtual time jumps when every process of a run is idle, and what
    reaches a live mesh (requests, faults) comes from outside the clock, so `--clock virtual`
    is refused (ValueError) and a `clock: virtual` scenario runs on the wall clock."""
    if clock == "virtual":
        raise ValueError("--clock virtual: a mesh that stays up runs on the wall clock (virtual "
                         "time jumps when every process of a run is idle, and requests and "
                         "faults sent to a live mesh come from outside it); `moemesh run` runs "
                         "a scenario in virtual time")
    changes: dict[str, Any] = {"clock": "realtime"}
    changes.update({k: v for k, v in (("runtime", runtime), ("shaper", shaper)) if v})
    if tdf is not None:
        if not tdf >= 1:
            raise ValueError(f"--tdf must be >= 1, got {tdf:g}")
        changes.update(time_dilation=tdf, auto_dilation=False)
    return replace(scenario, **changes)


async def _main(folder: Path, args: argparse.Namespace) -> int:
    from orchestrator.mesh.live import LiveMesh
    from orchestrator.placement import place, problem_from_scenario
    from orchestrator.scenario.arms import load_scenario

    sup = Supervisor(folder, args)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sup.stop.set)
    token = os.environ.get("MOEMESH_TOKEN") or secrets.token_hex(16)
    from orchestrator.runtimes.local import process_start_ticks

    sup.save(version=1, status="starting", error="", scenario=str(args.scenario),
             supervisor={"pid": os.getpid(), "start_ticks": process_start_ticks(os.getpid())},
             socket=str(folder / SOCKET_FILE), log=str(folder / LOG_FILE), token=token,
             started=time.time(), endpoints={}, processes={})
    try:
        scenario = live_scenario(load_scenario(args.scenario), runtime=args.runtime,
                                 shaper=args.shaper, tdf=args.tdf)
        policy = args.policy or scenario.placement.policy
        sup.save(name=scenario.name, runtime=scenario.runtime, policy=policy, clock="realtime",
                 time_dilation=scenario.time_dilation)
        result = place(problem_from_scenario(replace(
            scenario, placement=replace(scenario.placement, policy=policy))), policy)
        runtime = make_runtime(scenario.runtime, folder / "logs", token)
        mesh = LiveMesh(scenario, runtime, result, token=token, work_dir=folder / "work")
    except Exception as exc:
        bad = isinstance(exc, ValueError)
        sup.save(status="failed", bad_input=bad,
                 error=str(exc) if bad else f"{type(exc).__name__}: {exc}")
        return 2 if bad else 1
    sup.mesh = mesh
    try:
        starting = asyncio.ensure_future(mesh.start())
        stopper = asyncio.ensure_future(sup.stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped while starting: start() cleans up when cancelled
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
            sup.save(status="failed", error="stopped while starting")
            return 1
        stopper.cancel()
        starting.result()
        procs = getattr(runtime, "processes", dict)()
        sup.save(status="ready", expected_cost_ms=result.expected_cost_ms,
                 shaper=mesh.shaper, router_mounted=mesh.router_mounted,
                 endpoints={n: {"url": ep.url, "address": ep.address, "port": ep.port}
                            for n, ep in mesh.endpoints.items()},
                 processes={n: list(p) for n, p in procs.items()})
        async with asyncio.TaskGroup() as sup.reverts:
            server = await asyncio.start_unix_server(lambda r, w: _serve(sup, r, w),
                                                     path=str(folder / SOCKET_FILE))
            try:
                os.chmod(folder / SOCKET_FILE, 0o600)
                await sup.stop.wait()
            finally:
                server.close()
                for task in list(sup.pending):  # a revert not yet due is not applied
                    task.cancel()
        sup.save(status="stopping")
        return 0
    except Exception as exc:
        sup.save(status="failed", error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    finally:
        await to_the_end(mesh.stop())


def make_runtime(name: str, log_dir: Path, token: str) -> Any:
    """The runtime object of a scenario's `runtime:` (orchestrator.runtimes); `token` is the
    mesh token (the container runtimes write it into the nodes themselves)."""
    from orchestrator.runtimes import make_runtime as by_name

    options = {"local": {"log_dir": log_dir}, "netns": {"keep_logs": False}}.get(name, {})
    return by_name(name, token, **options)


async def _serve(sup: Supervisor, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    try:
        line = await reader.readline()
        try:
            answer = await _answer(sup, json.loads(line))
        except ValueError as exc:
            answer = {"ok": False, "error": str(exc), "bad_input": True}
        except Exception as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "bad_input": False}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
    finally:
        writer.close()


async def _answer(sup: Supervisor, req: Any) -> dict[str, Any]:
    from orchestrator.mesh.faults import fault_from_data
    from orchestrator.scenario.yamlio import Loc

    if not isinstance(req, dict) or req.get("op") not in ("status", "fault", "down"):
        raise ValueError(f"unknown request {req!r}: op must be status, fault or down")
    if req["op"] == "down":
        sup.stop.set()
        return {"ok": True}
    if req["op"] == "status":
        status = await sup.mesh.status()
        pending = [t.get_name() for t in sup.pending]
        return {"ok": True, "status": {**status, "pending": pending,
                                       "history": sup.history[-20:]}}
    fault = fault_from_data(req.get("fault"), Loc(None, "fault"))
    detail = await sup.mesh.apply_fault(fault)
    sup.history.append({"time": time.time(), "fault": fault.describe()})
    undo = fault.undo()
    if undo is not None:
        async def later() -> None:
            await asyncio.sleep(fault.for_s or 0.0)
            try:
                await sup.mesh.apply_fault(undo)
            except Exception as exc:  # a failed revert is told, and the mesh goes on
                sup.history.append({"time": time.time(), "fault": undo.describe(),
                                    "error": f"{type(exc).__name__}: {exc}"})
                return
            sup.history.append({"time": time.time(), "fault": undo.describe()})

        if sup.reverts is None:
            raise RuntimeError("the mesh is not serving")
        task = sup.reverts.create_task(later(), name=f"{undo.describe()} in {fault.for_s:g} s")
        sup.pending.add(task)
        task.add_done_callback(sup.pending.discard)
    return {"ok": True, "fault": fault.describe(), "detail": detail,
            "revert_in_s": fault.for_s}


def _detach(folder: Path) -> None:
    """Fork: the parent prints the child's pid and exits; the child leads a new session with
    its output in the log (nothing heavy is imported yet, so forking is safe)."""
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.setsid()
    log = os.open(folder / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "meshd", _supervise)
    parser.add_argument("--dir", type=Path, required=True, help="the mesh's state folder")
    parser.add_argument("--scenario", type=Path, required=True, help="scenario YAML")
    from orchestrator.scenario.scenario import RUNTIMES, SHAPERS

    parser.add_argument("--runtime", choices=RUNTIMES)
    parser.add_argument("--shaper", choices=SHAPERS)
    parser.add_argument("--policy", help="placement policy (default: the scenario's)")
    parser.add_argument("--tdf", type=float, help="time dilation (default: the scenario's)")
    parser.add_argument("--detach", action="store_true",
                        help="fork, print the supervisor's pid and return at once; the "
                        "supervisor runs in a session of its own, its output in DIR/meshd.log")


def _supervise(args: argparse.Namespace) -> int:
    """the supervisor of a mesh that `moemesh up` starts (not run by hand)

    Own a mesh between `moemesh up` and `moemesh down`: start it, answer the CLI on
    DIR/control.sock, stop it on SIGTERM, SIGINT or a down request.
    """
    folder = args.dir
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if args.detach:
        _detach(folder)
    try:
        code = asyncio.run(_main(folder, args))
    finally:
        with contextlib.suppress(FileNotFoundError):
            (folder / SOCKET_FILE).unlink()
    state = read_state(folder) or {}
    if state.get("status") != "failed":  # a failed start stays for `moemesh up` to read
        with contextlib.suppress(FileNotFoundError):
            (folder / STATE_FILE).unlink()
    return code
