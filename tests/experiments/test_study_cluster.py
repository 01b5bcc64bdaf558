"""Studies as tasks of a Ray cluster (experiments.study.executors; `moemesh study --executor ray`).

The slow tests start a real two-node Ray cluster on this host (`ray start --head` and a second
`ray start --address`, each told it has CPUS cores, in a temporary folder of their own) and
stop exactly its processes afterwards. Without Ray the `--executor ray` flag exits 2 naming
the install command; that test blocks `import ray` (the one stand-in here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from experiments.study.executors import (
    INSTALL,
    TEMP_PREFIX,
    WorldsFailed,
    pack,
    run_world_task,
    unpack,
)
from experiments.study.run import world_done
from experiments.study.worlds import draw_worlds
from tests.experiments.test_study import _tokens  # tokens.csv but dense_host_ms
from tests.helpers import ROOT, alive, env, free_port, machine, moemesh, moemesh_process

QUICKSTART = ROOT / "experiments" / "scenarios" / "quickstart.yaml"
FG_ACCESS = ROOT / "experiments" / "scenarios" / "fg-access.yaml"  # ten nodes: 11 CPUs a world
CPUS = 6  # a quickstart world: five nodes and the controller
NODE = "orchestrator.cli node"  # a mesh node's command line
WORLD_TASK = "ray::moemesh-world-"  # a Ray worker's title while it runs a world


# -- fast ---------------------------------------------------------------------------------------

def test_without_ray_the_executor_flag_exits_2_naming_the_install_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is absent
    out = tmp_path / "study"
    assert moemesh("study", str(QUICKSTART), "--executor", "ray", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "--executor ray: Ray is not installed" in err and INSTALL in err
    assert not out.exists()  # refused before anything was claimed or run
    assert machine.missing("ray") == f"Ray is not installed: {INSTALL}"


def test_the_cluster_flags_refuse_what_they_cannot_mean(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = str(tmp_path / "study")
    assert moemesh("study", str(QUICKSTART), "--address", "10.0.0.5:6379", "--out", out) == 2
    assert "--address: only with --executor ray" in capsys.readouterr().err
    assert moemesh("study", str(QUICKSTART), "--executor", "ray", "--jobs", "2",
                   "--out", out) == 2
    assert "--jobs: not with --executor ray" in capsys.readouterr().err


def test_a_worlds_folder_travels_whole_and_replaces_what_was_there(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "parts" / "greedy").mkdir(parents=True)
    (src / "tokens.csv").write_text("policy,request\ngreedy,0\n")
    (src / "parts" / "greedy" / "part.json").write_text("{}")
    (src / ".moemesh-marker").write_text('{"status": "finished"}')
    (src / "bars.png").write_bytes(bytes(range(256)) * 64)
    dest = tmp_path / "out" / "worlds" / "t1-w2"
    dest.mkdir(parents=True)
    (dest / "stale.csv").write_text("from the stopped run")
    unpack(pack(src), dest)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    assert got == [".moemesh-marker", "bars.png", "parts", "parts/greedy",
                   "parts/greedy/part.json", "tokens.csv"]
    assert (dest / "bars.png").read_bytes() == (src / "bars.png").read_bytes()
    with pytest.raises(tarfile.ReadError):
        unpack(b"not an archive", dest)
    assert (dest / "tokens.csv").read_text() == "policy,request\ngreedy,0\n"  # left as it was
    assert sorted(p.name for p in dest.parent.iterdir()) == ["t1-w2"]  # no staging left


def test_a_world_needs_a_cpu_per_mesh_process_and_refuses_another_commit(tmp_path: Path) -> None:
    from experiments.commands import _prepare
    from experiments.study.command import WorldRunner
    from experiments.study.worlds import generator_of
    from orchestrator.cli import build_parser

    args = build_parser().parse_args(["study", str(QUICKSTART)])
    scenario, arms, notes = _prepare(args)
    runner = WorldRunner(arms, None, notes, scenario, generator_of(scenario))
    world = draw_worlds(1, 1, 1)[0]
    assert runner.processes(world) == len(scenario.topology.nodes) + 1 == CPUS
    one, *_ = _prepare(build_parser().parse_args(["study", str(QUICKSTART), "--workers", "1"]))
    assert WorldRunner(arms, None, notes, one, generator_of(one)).processes(world) == 1
    with pytest.raises(ValueError, match=r"world t\d+-w\d+: this worker .* runs commit \w+, "
                                         r"the study commit 0000000: check out the same"):
        run_world_task(runner, world, None, "0000000", scenario.source_sha256, None)
    failed = WorldsFailed([("t1-w2", "WorkerCrashedError, after one retry: died"),
                           ("t3-w4", "ValueError: bad (at runner.py:10)")])
    assert str(failed) == ("2 world(s) failed (each runs again with --resume): t1-w2: "
                           "WorkerCrashedError, after one retry: died; t3-w4: ValueError: bad "
                           "(at runner.py:10)")


# -- a real Ray cluster ------------------------------------------------------------------------

@dataclass(frozen=True)
class Cluster:
    address: str
    temp: Path  # the cluster's --temp-dir: every one of its daemons names it

    def pids(self) -> list[int]:
        """The cluster's processes: its daemons, their workers and what those started."""
        return _tree([pid for pid, cmd in _processes().items() if str(self.temp) in cmd])

    def with_title(self, marker: str) -> list[int]:
        cmds = _processes()
        return [pid for pid in self.pids() if marker in cmds.get(pid, "")]


def _processes() -> dict[int, str]:
    """pid -> command line of every live process, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" "
                                                                                 ).decode()
            except OSError:
                continue
    return out


def _tree(roots: list[int]) -> list[int]:
    """`roots` and all their live descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found and alive(pid):
            found.append(pid)
            todo += children.get(pid, [])
    return found


def _ray(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and a worker node, CPUS cores each, on free ports, in a folder of their own."""
    machine.require("ray", machine.missing("ray"))
    temp = Path(tempfile.mkdtemp(prefix="mm-ray-", dir="/tmp"))  # short: socket paths
    port = free_port()
    common = ["start", f"--num-cpus={CPUS}", "--disable-usage-stats",
              f"--object-store-memory={200 * 2**20}"]

    def agent_ports() -> list[str]:
        return [f"--{flag}={free_port()}" for flag in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
            "runtime-env-agent-port", "metrics-export-port")]

    made = Cluster(f"127.0.0.1:{port}", temp)
    try:
        _ray(*common, "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
             "--include-dashboard=false", f"--temp-dir={temp}",
             *agent_ports())
        _ray(*common, f"--address={made.address}", "--node-ip-address=127.0.0.1",
             *agent_ports())
        yield made
    finally:
        _stop_cluster(made)


def _stop_cluster(made: Cluster) -> None:
    """End exactly this cluster's processes (by pid: not `ray stop`, which ends every
    cluster of this user on the host), then remove its folder."""
    import shutil

    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for pid in made.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while made.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
    assert made.pids() == [], "the test's Ray cluster did not stop"
    shutil.rmtree(made.temp, ignore_errors=True)


_TASKS = """
import json, sys, ray
from ray._private import state
from ray.core.generated import common_pb2
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
ended = {"FINISHED", "FAILED"}
tasks = []
for ev in state.state._get_all_task_events():  # from the GCS: the state API needs a dashboard
    names = {common_pb2.TaskStatus.Name(k) for k in ev.state_updates.state_ts_ns}
    if ev.task_info.name.startswith("moemesh-world-"):
        tasks.append([ev.task_info.name, "RUNNING" in names and not names & ended])
print(json.dumps({"tasks": tasks, "cpus": [ray.available_resources().get("CPU", 0.0),
                                           ray.cluster_resources().get("CPU", 0.0)]}))
"""


def _task_states(made: Cluster) -> dict:
    """The world tasks the cluster recorded ([name, running]) and its free and total CPUs:
    asked in a process of its own (a driver of its own), never through the code under test."""
    done = subprocess.run([sys.executable, "-c", _TASKS, made.address], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _study(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", "study", *args, "--quiet"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_study_on_ray_gives_the_worlds_and_comparisons_of_a_local_one(
        cluster: Cluster, tmp_path: Path) -> None:
    base = [str(QUICKSTART), "--topologies", "2", "--seeds", "1"]
    t0 = time.monotonic()
    on_ray = moemesh_process("study", *base, "--executor", "ray", "--address", cluster.address,
                             "--out", str(tmp_path / "ray"), "--quiet", timeout_s=500)
    ray_s = time.monotonic() - t0
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    t0 = time.monotonic()
    here = moemesh_process("study", *base, "--executor", "local", "--out",
                           str(tmp_path / "local"), "--quiet", timeout_s=400)
    local_s = time.monotonic() - t0
    assert here.returncode == 0, here.stderr[-3000:]
    print(f"quickstart, 2 worlds: ray {ray_s:.0f} s, local {local_s:.0f} s")
    ray_data = json.loads((tmp_path / "ray" / "study.json").read_text())
    local_data = json.loads((tmp_path / "local" / "study.json").read_text())
    names = [w.name for w in draw_worlds(1, 2, 1)]
    assert [w["name"] for w in ray_data["worlds"]] == names
    assert [r["attempts"] for r in ray_data["ran"]] == [1, 1]  # started once each, on Ray
    for name in names:
        assert world_done(tmp_path / "ray" / "worlds" / name)
        assert _tokens(tmp_path / "ray" / "worlds" / name) == _tokens(
            tmp_path / "local" / "worlds" / name)
    assert ray_data["comparisons"] == local_data["comparisons"]
    assert not ray_data["version_notes"]
    # a world no host can take is refused up front (Ray would queue it for ever)
    too_big = moemesh_process("study", str(FG_ACCESS), "--topologies", "1", "--seeds", "1",
                              "--executor", "ray", "--address", cluster.address, "--out",
                              str(tmp_path / "big"), "--quiet", timeout_s=120)
    assert too_big.returncode == 2, too_big.stderr[-2000:]
    assert (f"a world takes 11 CPUs on one host (one per mesh process: its nodes and the "
            f"controller), and the largest of the 2 host(s) of the cluster at "
            f"{cluster.address} has {CPUS}") in too_big.stderr
    # --resume on Ray runs nothing that is complete
    again = moemesh_process("study", *base, "--executor", "ray", "--address", cluster.address,
                            "--out", str(tmp_path / "ray"), "--quiet", "--resume",
                            timeout_s=120)
    assert again.returncode == 0, again.stderr[-2000:]
    redo = json.loads((tmp_path / "ray" / "study.json").read_text())
    assert [r["ran"] for r in redo["ran"]] == [False, False]
    assert redo["comparisons"] == ray_data["comparisons"]


def _wait_for_worlds(made: Cluster, proc: subprocess.Popen, worlds: int,
                     timeout_s: float = 150.0) -> list[int]:
    """The Ray workers running worlds, once `worlds` of them have a whole mesh up."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for w in made.with_title(WORLD_TASK)
                   if sum(NODE in c for p, c in _processes().items() if p in _tree([w])) >= 5]
        if len(workers) >= worlds:
            return workers
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no world's mesh came up on the cluster"
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.ray
def test_a_world_whose_worker_is_killed_is_retried_and_the_study_completes(
        cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "study"
    cmd = _study(str(QUICKSTART), "--topologies", "1", "--seeds", "1", "--requests", "4",
                 "--executor", "ray", "--address", cluster.address, "--out", str(out))
    t0 = time.monotonic()
    with subprocess.Popen(cmd, cwd=ROOT, env=env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            (worker,) = _wait_for_worlds(cluster, proc, 1)
            nodes = [p for p in _tree([worker]) if NODE in _processes().get(p, "")]
            assert len(nodes) == 5
            os.kill(worker, signal.SIGKILL)
            _, err = proc.communicate(timeout=240)
        finally:
            proc.kill()
    print(f"quickstart, 1 world of 4 requests, its worker killed once: "
          f"{time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, err[-3000:]
    data = json.loads((out / "study.json").read_text())
    (ran,) = data["ran"]
    assert ran["ran"] and ran["attempts"] == 2  # started, killed, started again
    assert world_done(out / "worlds" / ran["world"])
    assert not alive(worker) and not [p for p in nodes if alive(p)]  # its mesh died with it
    # the killed attempt's folder was removed by the next world task on that host
    assert not list(Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}{worker}-*"))


@pytest.mark.slow
@pytest.mark.ray
def test_ctrl_c_cancels_the_queued_worlds_and_stops_the_running_ones(
        cluster: Cluster, tmp_path: Path) -> None:
    """Three worlds on two hosts of one world each: two run, one waits. SIGINT: the waiting
    one never starts, the running ones stop their meshes, and no world task is left running."""
    out = tmp_path / "study"
    cmd = _study(str(QUICKSTART), "--topologies", "3", "--seeds", "1", "--requests", "30",
                 "--executor", "ray", "--address", cluster.address, "--out", str(out))
    with subprocess.Popen(cmd, cwd=ROOT, env=env(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        try:
            workers = _wait_for_worlds(cluster, proc, 2)
            nodes = [p for p in _tree(workers) if NODE in _processes().get(p, "")]
            running = _task_states(cluster)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=90)
            stop_s = time.monotonic() - t0
        finally:
            proc.kill()
    print(f"Ctrl-C to exit: {stop_s:.1f} s")
    assert proc.returncode == 130, err[-3000:]
    assert "moemesh: interrupted" in err
    assert stop_s < 25.0  # the worlds stopped when asked, not killed after the grace period
    # what the checks below look at was there: two worlds' tasks running, their meshes up
    assert sorted(t[1] for t in running["tasks"] if t[0].startswith("moemesh-world-")
                  ) [-2:] == [True, True] and running["cpus"][0] == 0 and len(nodes) == 10
    assert [p for p in nodes if alive(p)] == []
    assert cluster.with_title(NODE) == [] and cluster.with_title(WORLD_TASK) == []
    states = _task_states(cluster)
    mine = [t for t in states["tasks"] if t[1]]
    assert mine == [], f"world tasks still running: {mine}"
    free, total = states["cpus"]
    assert free == total == 2 * CPUS  # nothing holds a core
    assert not (out / "worlds").exists() or not any((out / "worlds").iterdir())
