"""`moemesh bench lookahead`: what conservative windows would cost on the shipped topologies.

For every topology under experiments/scenarios/topologies/ and the random meshes of `bench
scale` (`random_topology(N, 31)` scaled for tiny-moe; 40 and 100 nodes), and k = 1, 2, 4, 8, 16
partitions (`orchestrator.partitioner.partition`, every node the same load unless `--load
users`): the groups, the lookahead, the balance (heaviest share over the mean) and what one
barrier per window costs of each emulated millisecond. A window is at most the lookahead long,
so a run takes at most 1000 / lookahead_ms windows per virtual second, and the barrier's wall
time per emulated ms is cost_ms / lookahead_ms (an upper bound: a window in which nothing
happens can be skipped when the barrier also carries each partition's next event time).

The costs are measured here, two processes on this host:

* `shm_us`: a barrier in shared memory, one 8-byte slot per process that only it writes; each
  writes its round and spins (`os.sched_yield`) until every slot has reached it: no message,
  no lock, no system call but the yield;
* `futex_us`: `multiprocessing.Barrier(2)` (POSIX semaphores: the process sleeps in the
  kernel until the other arrives), for comparison;
* `tcp_loopback_us`: one round trip of 8 bytes over TCP on loopback (TCP_NODELAY), what a
  coordinator process on the same host would cost a window.

A barrier across hosts is taken as one LAN round trip (0.2 and 0.5 ms) plus the shared-memory
barrier among the host's own workers (docs/partitions.md).

    python -m bench.lookahead [--json] [--rounds 20000] [--repeats 3] [--load equal|users]
                              [--ks 1,2,4,8,16] [--random 40,100] [--scenario FILE ...]

`--scenario FILE` adds that scenario's topology with each node weighed by its placement's
expected work (`orchestrator.partitioner.scenario_load`: the rows the router sends it and the
dense steps of the requests it homes).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "command", "main", "measure_barriers", "rows", "scenario_rows",
           "topologies"]

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ROOT / "experiments" / "scenarios" / "topologies"
SEED = 31  # bench scale's seed
KS = (1, 2, 4, 8, 16)
RANDOM_NODES = (40, 100)
LAN_RTT_MS = (0.2, 0.5)


# -- barriers between two processes -------------------------------------------------------

def _shm_rounds(slots: Any, me: int, start: int, n: int) -> None:
    """Barriers start+1 .. start+n on the shared slots: write my round, yield until the
    other's is there too (one writer a slot, so no atomic read-modify-write is needed)."""
    view = memoryview(slots).cast("B").cast("q")
    other = 1 - me
    for r in range(start + 1, start + n + 1):
        view[me] = r
        while view[other] < r:
            os.sched_yield()


def _futex_rounds(barrier: Any, rounds: int) -> None:
    for _ in range(rounds):
        barrier.wait()


def _echo(port: int, rounds: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            _read(s, 8)
            s.sendall(b"12345678")


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("bench lookahead: the echo peer closed early")
        data += chunk
    return data


def _timed(run: Any, rounds: int) -> float:
    """µs per round of `run(rounds)`, the first round (the peer's start) not counted."""
    run(1)
    t0 = time.perf_counter()
    run(rounds)
    return (time.perf_counter() - t0) / rounds * 1e6


def _shm_us(ctx: Any, rounds: int) -> float:
    slots = ctx.RawArray("q", 2)
    peer = ctx.Process(target=_shm_rounds, args=(slots, 1, 0, rounds + 1), daemon=True)
    peer.start()
    done = [0]

    def run(n: int) -> None:
        _shm_rounds(slots, 0, done[0], n)
        done[0] += n

    try:
        return _timed(run, rounds)
    finally:
        peer.join(30)


def _futex_us(ctx: Any, rounds: int) -> float:
    barrier = ctx.Barrier(2)
    peer = ctx.Process(target=_futex_rounds, args=(barrier, rounds + 1), daemon=True)
    peer.start()
    try:
        return _timed(lambda n: _futex_rounds(barrier, n), rounds)
    finally:
        peer.join(30)


def _tcp_us(ctx: Any, rounds: int) -> float:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        peer = ctx.Process(target=_echo, args=(server.getsockname()[1], rounds + 1),
                           daemon=True)
        peer.start()
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def run(n: int) -> None:
                for _ in range(n):
                    conn.sendall(b"abcdefgh")
                    _read(conn, 8)

            try:
                return _timed(run, rounds)
            finally:
                peer.join(30)


def measure_barriers(rounds: int = 20_000, repeats: int = 3) -> dict[str, Any]:
    """µs per barrier (shm, futex) and per TCP loopback round trip between two processes:
    the median of `repeats` runs of `rounds` each, every run listed."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    runs: dict[str, list[float]] = {"shm_us": [], "futex_us": [], "tcp_loopback_us": []}
    for _ in range(repeats):
        runs["shm_us"].append(_shm_us(ctx, rounds))
        runs["futex_us"].append(_futex_us(ctx, rounds))
        runs["tcp_loopback_us"].append(_tcp_us(ctx, max(1, rounds // 4)))
    out: dict[str, Any] = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    out["runs"] = {k: [round(x, 2) for x in v] for k, v in runs.items()}
    out["rounds"] = rounds
    out["host_cpus"] = os.cpu_count()
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


# -- the table ------------------------------------------------------------------------------

def topologies(random_nodes: Sequence[int] = RANDOM_NODES) -> list[Any]:
    """The shipped topologies (by file name) and bench scale's random meshes."""
    from experiments.study.scaling import tiny_scaled
    from orchestrator.scenario.randomtopo import random_topology
    from orchestrator.scenario.topology import load_topology

    out = [load_topology(p) for p in sorted(TOPOLOGIES.glob("*.yaml"))]
    out += [tiny_scaled(random_topology(n, SEED)) for n in random_nodes]
    return out


def barrier_costs_ms(measured: Mapping[str, float],
                     lan_rtt_ms: Sequence[float] = LAN_RTT_MS) -> dict[str, float]:
    """Column → ms per barrier: the measured ones, and a LAN round trip plus the shm barrier
    (the workers of one host meet in shared memory, the hosts over the LAN)."""
    out = {"shm": measured["shm_us"] / 1000, "tcp_lo": measured["tcp_loopback_us"] / 1000}
    for rtt in lan_rtt_ms:
        out[f"lan{rtt:g}"] = rtt + measured["shm_us"] / 1000
    return out


def rows(topos: Sequence[Any], ks: Sequence[int], costs_ms: Mapping[str, float],
         load: str = "equal", loads: Sequence[Mapping[str, float] | None] | None = None
         ) -> list[dict[str, Any]]:
    """One row per topology and k: the partitioning and each barrier's share of an emulated
    ms (cost / lookahead; 0 with one partition, which needs no barrier). `load`: "equal" or
    "users" (each node's share of users); `loads`, one per topology, overrides it."""
    from orchestrator.partitioner import partition

    out = []
    for i, topo in enumerate(topos):
        weights = loads[i] if loads is not None else (
            topo.user_shares() if load == "users" else None)
        for k in ks:
            p = partition(topo, k, weights)
            look = p.lookahead_ms
            row: dict[str, Any] = {
                "topology": topo.name, "nodes": len(topo.nodes), "k": k,
                "partitions": len(p.groups), "sizes": [len(g) for g in p.groups],
                "lookahead_ms": None if math.isinf(look) else look,
                "balance": round(p.balance, 3),
                "windows_per_s": 0.0 if math.isinf(look) else round(1000 / look, 1),
            }
            for name, cost in costs_ms.items():
                row[f"{name}_ms_per_s"] = 0.0 if math.isinf(look) else round(
                    1000 / look * cost, 2)
                row[f"{name}_share"] = 0.0 if math.isinf(look) else round(cost / look, 4)
            out.append(row)
    return out


def scenario_rows(paths: Sequence[str], ks: Sequence[int], costs_ms: Mapping[str, float]
                  ) -> list[dict[str, Any]]:
    """Rows for scenarios, each node weighed by its placement's expected work
    (`orchestrator.partitioner.scenario_load`: seconds a scenario, its placement)."""
    from orchestrator.partitioner import scenario_load
    from orchestrator.scenario.arms import load_scenario

    scenarios = [load_scenario(p) for p in paths]
    out = rows([s.topology for s in scenarios], ks, costs_ms,
               loads=[scenario_load(s) for s in scenarios])
    for row, s in zip(out, (s for s in scenarios for _ in ks), strict=True):
        row["topology"] = f"{s.name} (placement)"
    return out


def _percent(row: Mapping[str, Any], cost: str) -> str:
    return "-" if row["lookahead_ms"] is None else f"{100 * row[cost + '_share']:.1f}%"


def render(doc: Mapping[str, Any]) -> str:
    b = doc["barrier_us"]
    costs = list(doc["costs_ms"])
    lines = [
        f"barrier between 2 processes on this host ({b['host_cpus']} CPUs, load "
        f"{b['loadavg_1m']}): shm {b['shm_us']} us, futex {b['futex_us']} us, TCP loopback "
        f"round trip {b['tcp_loopback_us']} us (median of {len(b['runs']['shm_us'])} x "
        f"{b['rounds']} rounds)",
        "barrier across hosts: LAN round trip + shm; share: barrier wall ms per emulated ms "
        "(every window taken)",
        "",
        f"{'topology':<28}{'n':>4}{'k':>4}{'parts':>6} {'lookahead':>9} {'balance':>7} "
        f"{'windows/s':>9}" + "".join(f" {c:>8}" for c in costs),
    ]
    for r in doc["rows"]:
        look = "-" if r["lookahead_ms"] is None else f"{r['lookahead_ms']:g}"
        shares = "".join(f" {_percent(r, c):>8}" for c in costs)
        lines.append(f"{r['topology']:<28}{r['nodes']:>4}{r['k']:>4}{r['partitions']:>6} "
                     f"{look:>9} {r['balance']:>7.3f} {r['windows_per_s']:>9g}{shares}")
    return "\n".join(lines)


def main(rounds: int = 20_000, repeats: int = 3, ks: Sequence[int] = KS,
         random_nodes: Sequence[int] = RANDOM_NODES, load: str = "equal",
         as_json: bool = False, scenarios: Sequence[str] = ()) -> int:
    barrier = measure_barriers(rounds, repeats)
    costs = barrier_costs_ms(barrier)
    doc = {"barrier_us": barrier, "costs_ms": costs, "load": load,
           "rows": rows(topologies(random_nodes), ks, costs, load)
           + scenario_rows(scenarios, ks, costs)}
    print(json.dumps(doc, indent=2) if as_json else render(doc))
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}"
                                         ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"integers >= 1, got {text!r}")
    return values


def command(args: argparse.Namespace) -> int:
    """conservative windows: lookahead, balance and barrier cost per topology and k

    Partitions every shipped topology and bench scale's random meshes into k = 1..16 groups
    (orchestrator.partitioner), measures a barrier between two processes (shared memory,
    futex, TCP loopback) and prints each barrier's share of an emulated millisecond.
    """
    return main(args.rounds, args.repeats, args.ks, args.random, args.load, args.json,
                args.scenario)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--rounds", type=int, default=20_000,
                        help="barriers per measurement (default 20000; TCP: a quarter)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements of each barrier, the median reported (default 3)")
    parser.add_argument("--ks", type=_ints, default=list(KS),
                        help="partition counts (default 1,2,4,8,16)")
    parser.add_argument("--random", type=_ints, default=list(RANDOM_NODES),
                        help="nodes of the random meshes (seed 31, default 40,100)")
    parser.add_argument("--load", choices=["equal", "users"], default="equal",
                        help="per-node load: the same for every node, or its share of users "
                             "(the homes of `home: users`)")
    parser.add_argument("--scenario", action="append", default=[], metavar="FILE",
                        help="also partition this scenario's topology, each node weighed by "
                             "its placement's expected work (repeatable; seconds each)")


if __name__ == "__main__":
    from .commands import standalone

    sys.exit(standalone("bench.lookahead", command, add_arguments))
