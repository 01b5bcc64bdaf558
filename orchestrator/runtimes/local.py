"""The `local` runtime: one node process per node on 127.0.0.1, no root, no namespaces.

Nodes share the host's loopback, so links are emulated by the nodes' `app` shaper (see
docs/architecture.md, Links).
Each node gets a free port of its own (kept across `kill` / `revive`, so peers' URLs stay
valid), its output goes to a log file, and it runs in a session of its own: `stop()` ends
exactly the process groups this runtime started (SIGTERM, then SIGKILL after a grace period),
by their ids. Nodes die with the process owning the runtime (Linux parent-death signal), so
nothing outlives it even without clean-up.

Node processes whose command is this Python are forked from a template process that has
imported torch, the project and the model once (`orchestrator.runtimes.forkserver`): a node
comes up, or back after a kill, in a fraction of a second instead of seconds of imports taken
from the running nodes. `fork_server=False` (or MOEMESH_FORK_SERVER=0) execs every node, as
does any other command. A starting node runs at low priority until it listens
(`orchestrator.runtimes.processes`).

    async with LocalRuntime() as rt:
        endpoints = await rt.start([NodeLaunch("edge1", ("python", "-m", "services", "node",
                                    "--name", "{name}", "--port", "{port}"))])
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from netem.markers import mark, process_alive, process_start_ticks
from orchestrator.mesh.lifetime import together, undone_on_error
from orchestrator.runtimes.base import Endpoint, NodeLaunch, RuntimeFailure, check_launches
from orchestrator.runtimes.forkserver import ForkServer, forkable
from orchestrator.runtimes.processes import (
    ProcessNode,
    ProcessRuntime,
    preexec,
    starting_nice,
)

__all__ = ["NODE_PRELOAD", "LocalRuntime", "process_alive", "process_start_ticks"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PORT_TRIES = 3  # a port picked free may be taken before the node binds it: try another
# What a `moemesh node` process imports beyond its entry module (the template imports it all;
# building the CLI's parser imports every command module).
NODE_PRELOAD = ("torch", "aiohttp", "uvloop", "services.serve", "services.node", "router.app",
                "orchestrator.cli:build_parser")


def _free_port(taken: set[int], host: str = HOST) -> int:
    """A port free now and not in `taken`: nodes are brought up together, and the kernel may
    hand out a port again once the probe closes, before the node that got it binds it."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            return port


def _fork_server_wanted(given: bool | None) -> bool:
    if given is not None:
        return given
    return os.environ.get("MOEMESH_FORK_SERVER", "1") != "0"


def _template_parts(launches: Sequence[NodeLaunch]) -> tuple[list[str], list[str]]:
    """Modules to import (each `-m` entry module beside NODE_PRELOAD) and the real-compute
    models to load once, read from the launches' command lines."""
    modules, models = list(NODE_PRELOAD), []
    for launch in launches:
        argv = launch.argv
        if len(argv) > 2 and argv[1] == "-m" and argv[2] not in modules:
            modules.append(argv[2])
        flags = dict(itertools.pairwise(argv))
        model = flags.get("--model")
        if model and "{" not in model and flags.get("--compute") != "modeled" and (
                model not in models):
            models.append(model)
    return modules, models


class LocalRuntime(ProcessRuntime):
    """Node processes on loopback (see the module docstring)."""

    name = "local"

    def __init__(
        self,
        *,
        ready_timeout_s: float = 120.0,
        stop_grace_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        keep_logs: bool = False,
        fork_server: bool | None = None,
    ) -> None:
        super().__init__()
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.env = dict(env or {})
        self.keep_logs = keep_logs or log_dir is not None
        self._log_dir_given = Path(log_dir) if log_dir is not None else None
        self.log_dir: Path | None = None
        self.fork_server = _fork_server_wanted(fork_server)
        self._forks: ForkServer | None = None
        self._started = False

    @property
    def spawn_mode(self) -> str:
        """How nodes start now: "fork" (from the template) or "exec"."""
        return "fork" if self._forks is not None and self._forks.alive else "exec"

    @property
    def template_pid(self) -> int | None:
        """The fork server's pid while it runs."""
        return self._forks.proc.pid if self.spawn_mode == "fork" and self._forks.proc else None

    # -- public -------------------------------------------------------------------------
    async def start(self, nodes: Sequence[NodeLaunch]) -> dict[str, Endpoint]:
        if self._started:
            raise RuntimeFailure("local runtime is already started")
        check_launches(nodes)
        self._started = True
        async with undone_on_error(self.stop):
            if self._log_dir_given is not None:
                self._log_dir_given.mkdir(parents=True, exist_ok=True)
                self.log_dir = self._log_dir_given
            else:
                self.log_dir = Path(tempfile.mkdtemp(prefix="moemesh-local-"))
                mark(self.log_dir, "logs", made=[*(f"{n.name}.log" for n in nodes), "template.log"])
                # moemesh clean: ours, whether it still runs, and what it made
            for launch in nodes:
                self._nodes[launch.name] = ProcessNode(launch, HOST, 0,
                                                       self.log_dir / f"{launch.name}.log")
            if self.fork_server and any(forkable(n.argv) for n in nodes):
                await self._start_template(nodes)
            await together(*(self._bring_up(n) for n in self._nodes.values()))
        return self.endpoints()

    def endpoints(self) -> dict[str, Endpoint]:
        return {name: Endpoint(name=name, host=HOST, port=n.port, address=HOST)
                for name, n in self._nodes.items()}

    async def stop(self) -> None:
        try:
            await self._end_all()
        finally:  # the template ends whatever it forked that is still there
            if self._forks is not None:
                await self._forks.close()
                self._forks = None
            if self.log_dir is not None and not self.keep_logs:
                shutil.rmtree(self.log_dir, ignore_errors=True)
                self.log_dir = None
            self._nodes.clear()
            self._started = False

    # -- internals ----------------------------------------------------------------------
    async def _start_template(self, nodes: Sequence[NodeLaunch]) -> None:
        """The fork server; where it cannot start, nodes are exec'd (said in the log)."""
        assert self.log_dir is not None
        modules, models = _template_parts(nodes)
        forks = ForkServer(log=self.log_dir / "template.log", env={**os.environ, **self.env},
                           preload=modules, models=models, ready_timeout_s=self.ready_timeout_s)
        try:
            await forks.start()
        except RuntimeFailure as exc:
            log.warning("local runtime: nodes start without the fork server: %s", exc)
            return
        self._forks = forks

    async def _bring_up(self, node: ProcessNode) -> None:
        for attempt in range(PORT_TRIES):
            node.port = _free_port({n.port for n in self._nodes.values() if n is not node})
            await self._start(node)
            try:
                await self._ready(node)
                return
            except RuntimeFailure:
                gone = node.proc is not None and node.proc.returncode is not None
                if not gone or "address already in use" not in self.log_tail(
                        node.launch.name).lower() or attempt == PORT_TRIES - 1:
                    raise

    async def _spawn(self, node: ProcessNode) -> None:
        assert node.log is not None
        env = {**os.environ, **self.env, **node.launch.env, "MOEMESH_NODE_NAME":
               node.launch.name}
        argv = node.launch.command(HOST, node.port)
        nice = starting_nice()
        if self._forks is not None and self._forks.alive and forkable(argv):
            node.proc = await self._forks.spawn(argv, env=env, log=node.log, nice=nice)
        else:
            with open(node.log, "ab") as out:
                node.proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                    start_new_session=True, preexec_fn=preexec(nice))
        node.start_ticks = process_start_ticks(node.proc.pid)
