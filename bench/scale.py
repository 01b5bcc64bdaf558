"""`moemesh bench scale`: what the emulator costs as meshes and loads grow, with and without
iteration-level batching (router.batching).

Each point is one `moemesh run` (a child process, virtual clock, app shaper, local runtime,
no quality scoring, no link probe: the probe crosses every pair, O(N^2), and at 40 and 100
nodes it was most of the run's virtual time and clock advances) of a random heterogeneous
mesh (`moemesh topology random --nodes N --seed 31`, scaled for tiny-moe with
`experiments.study.scaling.tiny_scaled`), the `hetroute` policy, Poisson arrivals at `rate_rps`
(default 0.4 req/s per node), prompts of 16-48 tokens, 12 tokens a request, for
`--duration` of scenario time. Per point:

* `virtual_speedup`: emulated seconds per wall second (run.json `clock_stats`);
* `cpu_ms_per_token`: the host CPU (user + system) of the run and all its processes (the node
  processes are its children), per emulated token; setup (placement, node start) included;
* `advances_per_token`: clock advances (netem.virtual) per emulated token;
* `pss_mib_per_node`: the mean over node processes of each one's peak PSS, sampled every
  `watch_interval_s` (0.1 s per node, at least 0.5 s: reading one node's smaps_rollup costs
  ~5 ms of CPU, and at 0.5 s for 100 nodes the watcher took a whole core from the run it
  measures); `watch_cpu_s` is the watcher's own CPU, not in `cpu_s`;
* `floor_ms_per_token`: the model's own decode step in this process (`bench.engine`'s
  in-process figure, median: tiny-moe `forward` of one token with a KV cache), what the emulation
  costs at the least;
* `wakes_per_advance`, `reports_per_advance`: processes the clock woke per advance (their
  timers were due), idle and busy reports it read per advance (run.json `clock_stats`);
* `clock_floor_speedup`: the speed a mesh with this run's events would reach if it did nothing
  but move its clock: virtual seconds over (advances x one clock round), the round measured
  in the same bench (`bench.clock`, `clock_round_us`: 4 processes, one woken a round, as
  in these runs). A run cannot be faster than this whatever its nodes cost; the clock's
  events are the emulated ones (a link's departure, a device's end), so they are not merged.

* `workers`, `windows`, `lookahead_ms`: how the mesh ran (None: a process a node, the
  reference; 1: the whole mesh in one partition, netem.virtual.partition, where a window is
  one event instant and there is no lookahead); `speedup_vs_processes`: a partitioned point's
  virtual speed over the reference point's (same nodes, batching and bench).

    python -m bench.scale [--json] [--nodes 5,10,20,40] [--per-node-rps 0.4]
                          [--batching none,iteration] [--duration 15s] [--large]
                          [--workers processes,1]

`--large` adds a 100-node point (minutes; memory: a process per node).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .commands import standalone

__all__ = ["add_arguments", "main", "run_point", "scenario_data", "watch_interval_s"]

ROOT = Path(__file__).resolve().parent.parent
SEED = 31
DEFAULT_NODES = (5, 10, 20, 40)
LARGE_NODES = 100
DEFAULT_MAX_ROWS = 256


def scenario_data(nodes: int, rate_rps: float, batching: str, duration_s: float,
                  max_rows: int = DEFAULT_MAX_ROWS, workers: int | None = None
                  ) -> dict[str, Any]:
    """The scenario of one point (plain data, topology inline)."""
    from experiments.study.scaling import tiny_scaled
    from orchestrator.scenario.randomtopo import random_topology
    from orchestrator.scenario.topology import topology_to_data

    topo = tiny_scaled(random_topology(nodes, SEED))
    data: dict[str, Any] = {
        "name": f"scale-{nodes}n-{batching}",
        "topology": topology_to_data(topo),
        "model": "tiny-moe", "runtime": "local", "shaper": "app", "clock": "virtual",
        "placement": {"policy": "hetroute", "redundancy": 2.0, "variants": ["fp16", "int8"]},
        "policies": ["hetroute"],
        "workload": {"arrival": "poisson", "rate_rps": rate_rps, "home": "users",
                     "prompt_tokens": [16, 48], "gen_tokens": 12, "duration": duration_s,
                     "warmup": 0.0, "seed": SEED},
    }
    if batching != "none":
        data["batching"] = {"mode": batching, "max_rows": max_rows}
    if workers is not None:
        data["workers"] = workers
    return data


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _pss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _is_node(pid: int) -> bool:
    """A `moemesh node` process (forked by the local runtime's fork server)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return b"node" in args and b"--name" in args


def watch_interval_s(nodes: int) -> float:
    """Seconds between PSS samples: the watcher's cost grows with the nodes (module
    docstring), so it samples less often on a large mesh."""
    return max(0.5, 0.1 * nodes)


def _watch(pid: int, peaks: dict[int, int], stop: threading.Event, every_s: float,
           spent: list[float], partitioned: bool = False) -> None:
    """Peak PSS of each node process under `pid` until `stop` (`partitioned`: of `pid`
    itself, which holds every node); the thread's CPU seconds go to `spent`."""
    t0 = time.thread_time()
    while not stop.wait(every_s):
        if partitioned:
            kib = _pss_kib(pid)
            if kib is not None:
                peaks[pid] = max(peaks.get(pid, 0), kib)
            continue
        for child in _descendants(pid):
            if child not in peaks and not _is_node(child):
                continue
            kib = _pss_kib(child)
            if kib is not None:
                peaks[child] = max(peaks.get(child, 0), kib)
    spent.append(time.thread_time() - t0)


def run_point(nodes: int, rate_rps: float, batching: str, duration_s: float,
              max_rows: int = DEFAULT_MAX_ROWS, timeout_s: float = 3600,
              workers: int | None = None) -> dict[str, Any]:
    """One `moemesh run` of the point's scenario; its figures (see the module docstring)."""
    from orchestrator.scenario.yamlio import dump_yaml

    with tempfile.TemporaryDirectory(prefix="moemesh-scale-") as tmp:
        path = Path(tmp) / "scenario.yaml"
        path.write_text(dump_yaml(scenario_data(nodes, rate_rps, batching, duration_s,
                                                max_rows, workers)))
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(path), "--quiet",
               "--quality-windows", "0", "--no-link-probe", "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get(
            "PYTHONPATH", "")}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        peaks: dict[int, int] = {}
        spent: list[float] = []
        stop = threading.Event()
        every = watch_interval_s(nodes)
        watcher = threading.Thread(target=_watch, args=(proc.pid, peaks, stop, every, spent,
                                                        workers is not None), daemon=True)
        watcher.start()
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        finally:
            stop.set()
            watcher.join()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"bench scale: the {nodes}-node run failed "
                               f"(exit {proc.returncode}): {log[-2000:]}")
        from experiments.run.runmeta import RunMeta

        meta = RunMeta.read(out / "run.json")
        with open(out / "tokens.csv") as f:
            tokens = sum(1 for _ in f) - 1
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    stats = meta.clock_stats or {}
    node_peaks = list(peaks.values())
    if workers is not None and node_peaks:  # one process holds them all
        node_peaks = [node_peaks[0] / nodes]
    return {
        "nodes": nodes, "rate_rps": rate_rps, "batching": batching, "workers": workers,
        "lookahead_ms": stats.get("lookahead_ms"), "windows": stats.get("windows"),
        "tokens": tokens,
        "virtual_speedup": stats.get("virtual_speedup"),
        "virtual_s": stats.get("virtual_s"), "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "cpu_ms_per_token": round(cpu * 1e3 / tokens, 3) if tokens else None,
        "advances": stats.get("advances"),
        "advances_per_token": round(stats["advances"] / tokens, 2)
        if tokens and stats.get("advances") is not None else None,
        **_per_advance(stats),
        "pss_mib_per_node": round(sum(node_peaks) / len(node_peaks) / 1024, 1)
        if node_peaks else None,
        "watch_interval_s": every, "watch_cpu_s": round(sum(spent), 2),
    }


def _per_advance(stats: dict[str, Any]) -> dict[str, float | None]:
    advances = stats.get("advances") or 0
    return {f"{k}_per_advance": round(stats[k] / advances, 3)
            if advances and stats.get(k) is not None else None for k in ("wakes", "reports")}


def clock_floor_speedup(point: dict[str, Any], round_us: float) -> float | None:
    """Virtual seconds over the wall the run's clock advances alone take (see the module
    docstring); None without advances."""
    if not point.get("advances") or not point.get("virtual_s") or not round_us > 0:
        return None
    return round(point["virtual_s"] / (point["advances"] * round_us * 1e-6), 2)


def floor_ms(tokens: int = 32) -> float:
    """The model's own decode step in this process (ms, median after a warm-up):
    bench.engine's in-process figure on tiny-moe."""
    import torch

    from bench.engine import PROMPT, _inprocess
    from moe.registry import load

    torch.set_num_threads(1)
    model = load("tiny-moe")
    _inprocess(model, list(PROMPT.encode()), tokens)  # warm-up
    times = sorted(_inprocess(model, list(PROMPT.encode()), tokens)[0])
    return times[len(times) // 2]


def run_grid(nodes: Sequence[int], per_node_rps: float, modes: Sequence[str],
             duration_s: float, max_rows: int = DEFAULT_MAX_ROWS,
             workers: Sequence[int | None] = (None,)) -> list[dict[str, Any]]:
    """Every point; `workers`: None, a process per node (the reference), or K partitions.
    A partitioned point's `speedup_vs_processes` is its virtual speed over the reference
    point's of the same nodes and batching, in the same bench."""
    from bench.clock import run_bench

    floor = round(floor_ms(), 4)
    round_us = run_bench()["clock_round_us"]
    points = []
    for n in nodes:
        for mode in modes:
            ref = None
            for k in workers:
                point = run_point(n, round(per_node_rps * n, 4), mode, duration_s, max_rows,
                                  workers=k)
                point["floor_ms_per_token"] = floor
                point["clock_round_us"] = round_us
                point["clock_floor_speedup"] = (clock_floor_speedup(point, round_us)
                                                if k is None else None)
                ref = point if k is None else ref
                point["speedup_vs_processes"] = _ratio(point, ref)
                points.append(point)
                print(f"bench scale: {n} nodes, {mode}, "
                      f"{'a process a node' if k is None else f'{k} worker(s)'}: "
                      f"{point['virtual_speedup']}x real time, {point['cpu_ms_per_token']} ms "
                      f"CPU a token", file=sys.stderr)
    return points


def _ratio(point: dict[str, Any], ref: dict[str, Any] | None) -> float | None:
    if ref is None or point is ref or not ref.get("virtual_speedup") or not point.get(
            "virtual_speedup"):
        return None
    return round(point["virtual_speedup"] / ref["virtual_speedup"], 3)


def _table(points: Sequence[dict[str, Any]]) -> str:
    cols = ("nodes", "rate_rps", "batching", "workers", "tokens", "virtual_speedup",
            "speedup_vs_processes", "cpu_ms_per_token", "advances_per_token",
            "clock_floor_speedup", "pss_mib_per_node", "floor_ms_per_token", "wall_s")
    rows = [cols] + [tuple(str(p.get(c)) for c in cols) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
                     for r in rows)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want node counts like 5,10,20, got {text!r}") from None
    if not values or any(not 2 <= v <= 200 for v in values):
        raise argparse.ArgumentTypeError(f"node counts must be in 2..200, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    from router.batching import BATCHING_MODES

    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in BATCHING_MODES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"batching modes are {', '.join(BATCHING_MODES)}, "
                                         f"got {text!r}")
    return values


def _duration(text: str) -> float:
    from orchestrator.scenario.units import parse_duration_s

    try:
        value = parse_duration_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--duration must be > 0, got {text!r}")
    return value


def _workers(text: str) -> list[int | None]:
    out: list[int | None] = []
    for v in (v.strip() for v in text.split(",") if v.strip()):
        if v == "processes":
            out.append(None)
        elif v == "1":
            out.append(1)
        else:
            raise argparse.ArgumentTypeError(
                f"workers are 'processes' (a process a node) or 1 (the whole mesh in one "
                f"partition; more partitions side by side are not built yet), got {v!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"want e.g. processes,1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the points as a JSON list")
    p.add_argument("--nodes", type=_ints, default=list(DEFAULT_NODES),
                   help="node counts, e.g. 5,10,20,40 (the default)")
    p.add_argument("--large", action="store_true",
                   help=f"add a {LARGE_NODES}-node point (minutes, a process per node)")
    p.add_argument("--per-node-rps", type=float, default=0.4,
                   help="requests per second per node, e.g. 0.4 (the default)")
    p.add_argument("--batching", type=_modes, default=["none", "iteration"],
                   help="batching modes to compare, e.g. none,iteration (the default)")
    p.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS,
                   help=f"rows a batched step may carry, e.g. {DEFAULT_MAX_ROWS} (the default)")
    p.add_argument("--duration", type=_duration, default=15.0,
                   help="scenario time of each run, e.g. 15s (the default)")
    p.add_argument("--workers", type=_workers, default=[None, 1],
                   help="how each point runs the mesh: processes (a process a node, the "
                        "reference) and/or 1 (one partition), e.g. processes,1 (the default: "
                        "both, and their ratio)")


def main(args: argparse.Namespace) -> int:
    """the emulator's cost over node counts and loads, with and without batching

    Runs a random mesh per node count (virtual clock, hetroute) and prints emulated seconds per
    wall second, host CPU ms per token, clock advances per token, PSS per node and the model's
    in-process step as the floor.
    """
    if not args.per_node_rps > 0:
        raise ValueError(f"--per-node-rps must be > 0, got {args.per_node_rps}")
    nodes = list(args.nodes) + ([LARGE_NODES] if args.large else [])
    points = run_grid(nodes, args.per_node_rps, args.batching, args.duration, args.max_rows,
                      args.workers)
    print(json.dumps(points, indent=2) if args.json else _table(points))
    return 0


if __name__ == "__main__":
    sys.exit(standalone("bench.scale", main, add_arguments))
