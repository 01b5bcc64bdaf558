"""Chaos: a seeded random fault timeline that never cuts off an expert, and the invariants a
run under it must keep.

Three parts, each usable alone (`experiments.chaos.run` puts them together for `moemesh chaos`):

* **The planner** (`plan_chaos`): pure, seeded. It draws faults one after another (exponential
  gaps): link-down, link-degrade (one-way delay x5 and 5% loss in each direction), node kill
  and revive, node-slow. A candidate is kept only if, at every instant it overlaps, the nodes
  and links down still leave every expert a reachable full-precision replica from every home
  node (a replica on the home itself, or on a live node whose link with the home is up both
  ways). A node still counts as down `revive_s` after its revive is due and anything that was
  down counts `settle_s` longer, the time a restart and the routers' breakers take. One fault
  per node or link at a time (a link-up ends a degrade and a cut alike, so they must not
  overlap), home nodes are never killed (their users would go with them), and everything is
  back up before the end.
* **The invariants** (`Invariants`): fed every token as it comes back, they record a
  violation for a token that failed for any reason but no reachable replica, or spent more
  quality than its budget.
* **Leaks** (`LeakProbe`): what the run left behind, by its own identities: processes below
  this one or naming the run's folder, the runtime's namespaces, qdiscs and links on its
  devices, its containers.

Times are scenario seconds from the workload's start, like every fault timeline.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe.vocab import FULL_PRECISION
from orchestrator.mesh.faults import Fault, LinkChange
from orchestrator.scenario.topology import Topology

__all__ = ["ALLOWED_FAILURES", "ChaosPlan", "ChaosSpec", "Invariants", "LeakProbe",
           "Violation", "cut_off", "fp_holders", "plan_chaos"]

# The router's reasons for a token with no reachable replica (router.dispatch); every other
# failure under a planned timeline is a broken promise.
ALLOWED_FAILURES = frozenset({"no_replica", "no_replica_reachable"})
KINDS = ("link-down", "link-degrade", "node-down", "node-slow")
Expert = tuple[int, int]
Link = frozenset[str]


@dataclass(frozen=True)
class ChaosSpec:
    """What to plan: how long, which seed, which homes send tokens, how often and how long
    faults come (scenario seconds)."""

    duration_s: float
    seed: int = 0
    homes: tuple[str, ...] = ()
    mean_gap_s: float = 3.0  # mean time between two fault starts
    hold_s: tuple[float, float] = (2.0, 8.0)  # how long one fault lasts (uniform)
    lead_s: float = 2.0  # no fault starts before this
    settle_s: float = 2.0  # a cut link or killed node counts as down this much longer
    revive_s: float = 3.0  # a revived node is not serving yet for this long
    slow: tuple[float, float] = (2.0, 4.0)  # node-slow factor (uniform)
    degrade_delay: float = 5.0  # link-degrade: one-way delay times this
    degrade_loss_pct: float = 5.0
    kinds: tuple[str, ...] = KINDS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration: must be > 0 s, got {self.duration_s!r}")
        if not self.homes:
            raise ValueError("homes: name at least one node that sends tokens")
        bad = sorted(set(self.kinds) - set(KINDS))
        if bad or not self.kinds:
            raise ValueError(f"kinds: must be some of {', '.join(KINDS)}, got {list(self.kinds)}")
        lo, hi = self.hold_s
        if not 0 < lo <= hi:
            raise ValueError(f"hold_s: need 0 < low <= high, got {self.hold_s}")
        if not self.mean_gap_s > 0:
            raise ValueError(f"mean_gap_s: must be > 0, got {self.mean_gap_s}")


@dataclass(frozen=True)
class _Span:
    """One planned fault's hold on its target: busy until `busy_end`, cutting `nodes` or
    `links` off until `down_end` (nothing for degrade and slow)."""

    start: float
    busy_end: float
    down_end: float
    nodes: frozenset[str] = frozenset()
    links: frozenset[Link] = frozenset()
    target: str | Link = ""


@dataclass(frozen=True)
class ChaosPlan:
    """The planned faults (each with its `for_s`), the timeline they make (faults and their
    reverts in time order) and how many candidates were refused for cutting an expert off."""

    spec: ChaosSpec
    faults: tuple[Fault, ...]
    refused: int

    @property
    def events(self) -> tuple[Fault, ...]:
        events = list(self.faults) + [u for u in (f.undo() for f in self.faults) if u]
        return tuple(sorted(events, key=lambda f: f.at_s))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.action] = out.get(f.action, 0) + 1
        return out


def fp_holders(placement: Mapping[str, Sequence[Mapping[str, Any]]]
               ) -> dict[Expert, frozenset[str]]:
    """(layer, expert) → the nodes holding a full-precision replica of it."""
    out: dict[Expert, set[str]] = {}
    for node, entries in placement.items():
        for e in entries:
            if e.get("variant") == FULL_PRECISION:
                out.setdefault((int(e["layer"]), int(e["expert"])), set()).add(node)
    return {k: frozenset(v) for k, v in out.items()}


def cut_off(holders: Mapping[Expert, frozenset[str]], homes: Iterable[str],
            down_nodes: frozenset[str], down_links: frozenset[Link]
            ) -> tuple[str, Expert] | None:
    """The first (home, expert) left without a reachable full-precision replica, or None."""
    for home in homes:
        if home in down_nodes:
            continue  # a down home sends nothing
        for expert, nodes in holders.items():
            if not any(n == home or (n not in down_nodes and frozenset((home, n))
                                     not in down_links) for n in nodes):
                return home, expert
    return None


class _Planner:
    def __init__(self, topology: Topology, placement: Mapping[str, Sequence[Mapping[str, Any]]],
                 spec: ChaosSpec) -> None:
        unknown = sorted(set(spec.homes) - set(topology.names))
        if unknown:
            raise ValueError(f"homes: unknown node(s) {', '.join(unknown)} (nodes: "
                             f"{', '.join(topology.names)})")
        self.topology, self.spec = topology, spec
        self.holders = fp_holders(placement)
        self.rng = random.Random(spec.seed)
        self.spans: list[_Span] = []
        self.faults: list[Fault] = []
        self.refused = 0
        names = topology.names
        self.pairs = [frozenset((a, b)) for i, a in enumerate(names) for b in names[i + 1:]]
        self.victims = [n for n in names if n not in spec.homes]

    def busy(self, target: str | Link, start: float, end: float) -> bool:
        return any(s.target == target and s.start < end and start < s.busy_end
                   for s in self.spans)

    def safe(self, cand: _Span) -> bool:
        """Every instant the candidate cuts something off leaves every expert reachable."""
        if not cand.nodes and not cand.links:
            return True
        near = [s for s in self.spans if (s.nodes or s.links) and s.start < cand.down_end
                and cand.start < s.down_end]
        instants = {cand.start} | {s.start for s in near if cand.start < s.start}
        for t in sorted(instants):
            live = [s for s in (*near, cand) if s.start <= t < s.down_end]
            nodes = frozenset().union(*(s.nodes for s in live))
            links = frozenset().union(*(s.links for s in live))
            if cut_off(self.holders, self.spec.homes, nodes, links) is not None:
                return False
        return True

    def candidate(self, kind: str, t: float, hold: float) -> tuple[list[Fault], _Span] | None:
        sp, rng, end = self.spec, self.rng, t + hold
        if kind == "node-down":
            if not self.victims:
                return None
            node = rng.choice(self.victims)
            span = _Span(t, end + sp.revive_s + sp.settle_s, end + sp.revive_s + sp.settle_s,
                         nodes=frozenset({node}), target=node)
            return [Fault(t, kind, (node,), for_s=hold)], span
        if kind == "node-slow":
            node = rng.choice(self.topology.names)
            factor = round(rng.uniform(*sp.slow), 2)
            return [Fault(t, kind, (node,), for_s=hold, factor=factor)], _Span(
                t, end + sp.settle_s, end, target=node)
        pair = rng.choice(self.pairs)
        a, b = sorted(pair)
        if kind == "link-down":
            span = _Span(t, end + sp.settle_s, end + sp.settle_s, links=frozenset({pair}),
                         target=pair)
            return [Fault(t, kind, (a, b), for_s=hold)], span
        faults = []
        for src, dst in ((a, b), (b, a)):  # each direction its own delay x5
            base = self.topology.link(src, dst)
            change = LinkChange(delay_ms=round(base.delay_ms * sp.degrade_delay, 3),
                                loss_pct=sp.degrade_loss_pct)
            faults.append(Fault(t, kind, (src, dst), for_s=hold, change=change, oneway=True))
        return faults, _Span(t, end + sp.settle_s, end, target=pair)

    def plan(self) -> ChaosPlan:
        sp, rng = self.spec, self.rng
        last_end = sp.duration_s - sp.settle_s - sp.revive_s  # everything back before the end
        t = sp.lead_s + rng.expovariate(1.0 / sp.mean_gap_s)
        while t + sp.hold_s[0] <= last_end:
            kind = rng.choice(sp.kinds)
            hold = min(rng.uniform(*sp.hold_s), last_end - t)
            made = self.candidate(kind, round(t, 3), round(hold, 3))
            if made is not None:
                faults, span = made
                if self.busy(span.target, span.start, span.busy_end):
                    pass  # its node or link already has a fault then: draw again later
                elif self.safe(span):
                    self.spans.append(span)
                    self.faults.extend(faults)
                else:
                    self.refused += 1
            t += rng.expovariate(1.0 / sp.mean_gap_s)
        return ChaosPlan(sp, tuple(sorted(self.faults, key=lambda f: f.at_s)), self.refused)


def plan_chaos(topology: Topology, placement: Mapping[str, Sequence[Mapping[str, Any]]],
               spec: ChaosSpec) -> ChaosPlan:
    """A seeded random timeline (see the module docstring); the same inputs give the same
    plan."""
    return _Planner(topology, placement, spec).plan()


# ----------------------------------------------------------------------------- invariants


@dataclass(frozen=True)
class Violation:
    kind: str  # failure | budget | missing | fault | leak
    detail: str


def base_reason(reason: str) -> str:
    """`after:X` (never ran after a failure) and `prompt:X` (a prompt position failed) → X."""
    for prefix in ("after:", "prompt:"):
        while reason.startswith(prefix):
            reason = reason[len(prefix):]
    return reason.split(":", 1)[0] if not reason.startswith("request") else reason


@dataclass
class Invariants:
    """Checks every token as it comes back (a `TokenRow`-like object: policy, request, index,
    status, reason, quality, reroutes) against the promise of a planned timeline."""

    budget: float  # the per-token quality budget (fraction)
    tolerance: float = 1e-9
    violations: list[Violation] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)  # policy → tokens
    ok: dict[str, int] = field(default_factory=dict)
    rerouted: dict[str, int] = field(default_factory=dict)  # tokens with a reroute
    reroutes: dict[str, int] = field(default_factory=dict)
    failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (policy, reason)
    max_quality: float = 0.0

    def check(self, row: Any) -> None:
        p = row.policy
        self.tokens[p] = self.tokens.get(p, 0) + 1
        self.reroutes[p] = self.reroutes.get(p, 0) + int(row.reroutes)
        if row.reroutes:
            self.rerouted[p] = self.rerouted.get(p, 0) + 1
        where = f"{p} request {row.request} token {row.index} (home {row.home})"
        quality = float(row.quality)
        self.max_quality = max(self.max_quality, quality)
        if quality > self.budget + self.tolerance:
            self.violations.append(Violation(
                "budget", f"{where} spent {quality:.4%} of quality, budget {self.budget:.4%}"))
        if row.status == "ok":
            self.ok[p] = self.ok.get(p, 0) + 1
            return
        reason = str(row.reason or "?")
        self.failures[(p, reason)] = self.failures.get((p, reason), 0) + 1
        if base_reason(reason) not in ALLOWED_FAILURES:
            self.violations.append(Violation("failure", f"{where} failed: {reason}"))

    def failed_allowed(self, reason: str) -> bool:
        return base_reason(reason) in ALLOWED_FAILURES


# ----------------------------------------------------------------------------- leaks


def _lines(argv: Sequence[str]) -> frozenset[str] | None:
    """The output lines of a listing command; None where the tool is missing or fails."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return frozenset(line.strip() for line in done.stdout.splitlines() if line.strip())


def _proc_children() -> dict[int, int]:
    """pid → parent pid of every process (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if rest and rest[0] != "Z":  # a zombie holds nothing
            out[int(entry.name)] = int(rest[1])
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


@dataclass
class LeakProbe:
    """Names what a run left behind (`left()`), by the run's own identities, so that other
    work on the same host is never counted: processes below this one or naming `work_dir`
    (node processes get their state folder there), the runtime's network namespaces
    (`ip netns list`), qdiscs and links on its devices (`tc qdisc show`, `ip -o link`), its
    containers (`docker ps -aq`). `own(runtime, endpoints)` learns those identities while
    the mesh is up. A process that was already there when the probe was made (this
    process's own helpers, such as multiprocessing's resource tracker) is not the run's."""

    work_dir: Path
    namespaces: set[str] = field(default_factory=set)
    devices: set[str] = field(default_factory=set)  # interface name prefixes
    containers: set[str] = field(default_factory=set)
    before: frozenset[tuple[int, str]] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.before:
            self.before = frozenset(self._found())

    def own(self, runtime: Any, endpoints: Mapping[str, Any]) -> None:
        self.namespaces |= {ep.netns for ep in endpoints.values() if ep.netns}
        run_id = getattr(runtime, "id", None)
        if isinstance(run_id, str) and self.namespaces:  # the netns runtime: mmb<id>, mmv<id>
            self.devices |= {f"mmb{run_id}", f"mmv{run_id}"}
        container_id = getattr(runtime, "container_id", None)
        if container_id is not None:
            for name in endpoints:
                try:
                    self.containers.add(str(container_id(name))[:12])
                except (KeyError, ValueError, RuntimeError):
                    continue

    def processes(self) -> list[str]:
        return [f"process {p}: {line[:120]}" for p, line in sorted(self._found())
                if (p, line) not in self.before]

    def _found(self) -> set[tuple[int, str]]:
        """(pid, command line) of each process below this one or naming `work_dir`."""
        parents = _proc_children()
        me, mine = os.getpid(), set()
        frontier = {me}
        while frontier:
            frontier = {p for p, pp in parents.items() if pp in frontier and p not in mine}
            mine |= frontier
        folder = str(self.work_dir)
        named = {p for p in parents if p != me and folder in _cmdline(p)}
        return {(p, _cmdline(p)) for p in mine | named}

    def left(self) -> list[str]:
        out = self.processes()
        if self.namespaces:
            listed = _lines(["ip", "netns", "list"]) or frozenset()
            out += [f"namespace: {line}" for line in sorted(listed)
                    if line.split()[0] in self.namespaces]
        if self.devices:
            for kind, argv in (("qdisc", ["tc", "qdisc", "show"]), ("link", ["ip", "-o", "link"])):
                out += [f"{kind}: {line}" for line in sorted(_lines(argv) or ())
                        if any(dev in line for dev in self.devices)]
        if self.containers:
            out += [f"container: {c}" for c in sorted(_lines(["docker", "ps", "-aq"]) or ())
                    if c[:12] in self.containers]
        return out
