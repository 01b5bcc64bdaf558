"""Where a study's worlds run: on this host, or as tasks of a Ray cluster (docs/cluster.md).

    moemesh study SCENARIO --topologies 8 --seeds 2                       # --executor local
    moemesh study SCENARIO --topologies 8 --seeds 2 --executor ray --address HEAD:6379

`local` runs the worlds here, `--jobs` at a time (experiments.study.run: `run_worlds`). `ray` makes
each world one Ray task (`run_world_task`) on the cluster at `--address` (none given: Ray's own
rule, `RAY_ADDRESS`, else the cluster `ray start` made on this host, else a one-host cluster
for the study's length). A world's task:

* holds one CPU per process its mesh starts (the world's nodes and the controller: Ray then
  places as many worlds on a host as it has cores for) and the memory `--jobs` allows a world
  here (WORLD_GIB); the study refuses up front when no host of the cluster has that much,
  where Ray would wait for one forever;
* carries the world (its topology and workload seeds), the scenario's hash and the driver's
  commit: a worker whose checkout is at another commit refuses it, naming both;
* runs the world in a temporary folder on its host, from the files the study's folder held
  for it (a stopped world runs only what it lacks, as here), and sends the folder back as a
  tar.gz, with the worker's package versions (orchestrator.lockfile); the study unpacks it
  into OUT/worlds/<world>. A world that raised sends what it wrote too: resumable.
* is retried once where its worker process died (`max_retries=1`); not where the world
  raised (it would raise again). A world that failed is reported by name with its reason once
  the others have finished, and the study exits 1; `--resume` runs it again.

Ctrl-C cancels what has not started and interrupts what runs (Ray raises KeyboardInterrupt
in the task, so its world stops its mesh as `moemesh run` does); a task still running after
`STOP_GRACE_S` is killed with its worker (its nodes die with it: parent-death signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import shutil
import signal
import socket
import tarfile
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .run import WorldsTally
    from .worlds import World

__all__ = ["EXECUTORS", "INSTALL", "TEMP_PREFIX", "Executor", "WorldRun", "WorldsFailed",
           "import_ray", "pack", "run_on_ray", "run_world_task", "unpack"]

EXECUTORS = ("local", "ray")
INSTALL = "python3 -m pip install -c requirements.lock -e '.[cluster]'"
STOP_GRACE_S = 30.0  # how long an interrupted world may take to stop its mesh
POLL_S = 0.5  # how often the driver looks for ended worlds (a Ctrl-C waits at most this long)
TEMP_PREFIX = "moemesh-world-"  # a world task's folder: TEMP_PREFIX, the worker's pid, "-"
NEWS_S = 2.0  # how often it asks which worlds started (each ask is a task the cluster records)


@dataclass(frozen=True)
class Executor:
    """Where the worlds run: `local` (`jobs` at a time here) or `ray` (the cluster at
    `address`; None: Ray's own rule, module docstring)."""

    kind: str = "local"
    jobs: int = 1
    address: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise ValueError(f"--executor: one of {', '.join(EXECUTORS)}, got {self.kind!r}")
        if self.address is not None and self.kind != "ray":
            raise ValueError("--address: only with --executor ray (the cluster to run on)")

    def check(self) -> None:
        """Refuse now, before anything runs, what could only fail later (Ray not installed)."""
        if self.kind == "ray":
            import_ray()


class WorldRun(Protocol):
    """What a study runs in a world (experiments.study.command.WorldRunner)."""

    scenario: Any

    def __call__(self, world: World, folder: Path) -> None: ...

    def processes(self, world: World) -> int: ...


class WorldsFailed(RuntimeError):
    """Worlds that failed on the cluster, each with its reason (the others finished)."""

    def __init__(self, failed: Sequence[tuple[str, str]]) -> None:
        self.failed = list(failed)
        lines = "; ".join(f"{name}: {reason}" for name, reason in self.failed)
        super().__init__(f"{len(self.failed)} world(s) failed (each runs again with "
                         f"--resume): {lines}")


def import_ray() -> Any:
    """The `ray` module, or ValueError (exit 2) naming the command that installs it."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"--executor ray: Ray is not installed in this environment; install "
                         f"it with {INSTALL}") from None
    return ray


# -- a world's folder, there and back -----------------------------------------------------------

def pack(folder: Path) -> bytes:
    """`folder`'s files as a tar.gz (names relative to it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
    return buf.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """Replace `folder` by the files of `data` (a `pack`): unpacked beside it first, so an
    archive that does not unpack leaves the folder as it was."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(staging, filter="data")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


# -- on a worker ---------------------------------------------------------------------------------

def run_world_task(run_one: WorldRun, world: World, files: bytes | None, commit: str | None,
                   scenario_sha256: str | None, board: Any) -> dict[str, Any]:
    """One world on a Ray worker (module docstring): its folder's files back, its wall time,
    the worker's host and package versions, and `error` where the world raised."""
    from orchestrator import lockfile

    from ..run.runner import code_commit

    here = code_commit()
    if here != commit:
        raise ValueError(f"world {world.name}: this worker ({socket.gethostname()}) runs "
                         f"commit {here or 'unknown (not a git checkout)'}, the study commit "
                         f"{commit or 'unknown'}: check out the same commit on every host")
    if run_one.scenario.source_sha256 != scenario_sha256:
        raise ValueError(f"world {world.name}: the scenario arrived with sha256 "
                         f"{run_one.scenario.source_sha256}, the study's is {scenario_sha256}")
    board.started.remote(world.name, socket.gethostname())
    _sweep()
    error = None
    with tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-") as tmp:
        folder = Path(tmp) / world.name
        folder.mkdir()
        if files:
            unpack(files, folder)
        t0 = time.monotonic()
        policy = asyncio.get_event_loop_policy()
        # a Ray worker sets uvloop's policy, whose lack of child watchers breaks the standard
        # loops' subprocesses (the mesh's nodes): the world runs on asyncio's own, as here
        asyncio.set_event_loop_policy(None)
        try:
            run_one(world, folder)
        except Exception as exc:  # what it wrote comes back: the world resumes from it
            traceback.print_exc()  # into the worker's log, where Ray keeps it
            error = _reason(exc)
        finally:
            asyncio.set_event_loop_policy(policy)
        wall = time.monotonic() - t0
        return {"files": pack(folder), "wall_s": wall, "error": error,
                "host": socket.gethostname(), "versions": lockfile.versions()}


def _sweep() -> None:
    """Remove the temporary folders of world tasks whose worker was killed (its pid is in
    the name): nothing else would, and a killed world's folder is a whole run's files."""
    for folder in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*-*"):
        pid = folder.name[len(TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _reason(exc: BaseException) -> str:
    """A world's failure in a line: the exception and where it was raised (the traceback
    is in the worker's log)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class _Board:
    """A Ray actor the tasks tell when they start (Ray tells the driver only when they end):
    the progress's `running`, and a second start of a world is its retry."""

    def __init__(self) -> None:
        self.news: list[tuple[str, str]] = []

    def started(self, world: str, host: str) -> None:
        self.news.append((world, host))

    def take(self) -> list[tuple[str, str]]:
        news, self.news = self.news, []
        return news


# -- on the driver -------------------------------------------------------------------------------

def run_on_ray(todo: Sequence[World], out: Path, run_one: WorldRun, tally: WorldsTally,
               address: str | None) -> dict[str, dict[str, Any]]:
    """Run `todo` as tasks of the Ray cluster at `address` into OUT/worlds (module docstring);
    per world that ran, where and how often it started. WorldsFailed at the end when any world
    failed, after the others have finished."""
    from orchestrator import lockfile

    from ..run.runner import code_commit
    from .command import WORLD_GIB

    ray = import_ray()
    _connect(ray, address)
    try:
        need = {w.name: run_one.processes(w) for w in todo}
        memory = int(WORLD_GIB * 2**30)
        _check_fits(ray, max(need.values(), default=0), memory, address)
        board = ray.remote(num_cpus=0)(_Board).remote()
        task = ray.remote(max_retries=1, retry_exceptions=False)(run_world_task)
        shared = ray.put(run_one)
        commit, sha = code_commit(), run_one.scenario.source_sha256
        pending = {}
        for w in todo:
            folder = out / "worlds" / w.name
            files = pack(folder) if folder.is_dir() and any(folder.iterdir()) else None
            ref = task.options(num_cpus=need[w.name], memory=memory,
                               name=f"moemesh-world-{w.name}").remote(shared, w, files, commit,
                                                                      sha, board)
            pending[ref] = w
        info: dict[str, dict[str, Any]] = {}
        try:
            failed = _collect(ray, pending, board, out, tally, info, lockfile.versions())
        except BaseException:
            _stop(ray, pending)
            raise
        if failed:
            raise WorldsFailed(failed)
        return info
    finally:
        ray.shutdown()


def _connect(ray: Any, address: str | None) -> None:
    """ray.init, keeping the command's SIGTERM handler (a SIGTERM stops a study as Ctrl-C
    does: orchestrator.cli), which ray.init replaces with an exit."""
    term = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ValueError(f"--address {address or os.environ.get('RAY_ADDRESS') or '(none)'}:"
                         f" no Ray cluster answers there: {exc}") from None
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)


def _check_fits(ray: Any, cpus: int, memory: int, address: str | None) -> None:
    """Refuse a world no host can take (Ray would hold its task pending for ever)."""
    hosts = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    where = address or os.environ.get("RAY_ADDRESS") or "the default address"
    most = max((h.get("CPU", 0.0) for h in hosts), default=0.0)
    if most < cpus:
        raise ValueError(f"--executor ray: a world takes {cpus} CPUs on one host (one per mesh "
                         f"process: its nodes and the controller), and the largest of the "
                         f"{len(hosts)} host(s) of the cluster at {where} has {most:g}: start "
                         f"a worker with `ray start --address HEAD:PORT --num-cpus {cpus}` or "
                         f"more")
    if not any(h.get("CPU", 0.0) >= cpus and h.get("memory", 0.0) >= memory for h in hosts):
        raise ValueError(f"--executor ray: a world takes {cpus} CPUs and {memory / 2**30:g} GiB "
                         f"of memory on one host, and no host of the cluster at {where} has "
                         f"both: start a worker with more memory (`ray start --memory BYTES`)")


def _collect(ray: Any, pending: dict[Any, World], board: Any, out: Path, tally: WorldsTally,
             info: dict[str, dict[str, Any]], mine: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Wait for every task; unpack each world as it ends. The failed worlds and why."""
    from orchestrator.lockfile import versions_note

    def news() -> None:  # which worlds started, and where, since the last look
        try:
            told = ray.get(board.take.remote())
        except ray.exceptions.RayError:  # the board's worker died: only the display loses
            told = []
        for name, host in told:
            entry = info.setdefault(name, {"host": host, "attempts": 0})
            entry["host"] = host
            entry["attempts"] += 1
            tally.started(name, retry=entry["attempts"] > 1)

    failed: list[tuple[str, str]] = []
    asked = 0.0
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        if ready or time.monotonic() - asked >= NEWS_S:
            asked = time.monotonic()
            news()
        for ref in ready:
            world = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                reason = _reason(exc.cause)
            except ray.exceptions.RayError as exc:  # its worker (or host) died, twice
                reason = (f"{type(exc).__name__}, after one retry: "
                          f"{str(exc).strip().splitlines()[0][:300]}")
            else:
                unpack(result["files"], out / "worlds" / world.name)
                reason = result["error"]
                note = versions_note(f"world {world.name} (on {result['host']}) against this "
                                     f"host", result["versions"], mine)
                if note:
                    tally.note(note)
            if reason is None:
                tally.finished(world.name, result["wall_s"])
            else:
                failed.append((world.name, reason))
                tally.failed(world.name, reason)
    news()  # a start told after its world ended still counts its attempt
    return failed


def _stop(ray: Any, pending: Mapping[Any, World]) -> None:
    """Cancel what has not started, interrupt what runs, and kill what is still running after
    STOP_GRACE_S (or at a second Ctrl-C)."""
    refs = list(pending)
    if not refs:
        return
    for ref in refs:
        ray.cancel(ref)
    left = refs
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: kill them now
        _, left = ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
    for ref in left:
        ray.cancel(ref, force=True)
    if left:
        ray.wait(left, num_returns=len(left), timeout=10.0)
