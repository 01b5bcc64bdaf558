"""Group a topology's nodes into partitions for conservative parallel windows (issue 51).

A partitioned run (docs/partitions.md) lets every partition run a window of emulated time at
once; the window may be as long as the *lookahead*, the least one-way delay a message between
two partitions can take, because nothing sent from another partition in the window can arrive
before its end. Longer windows mean fewer barriers, and the slowest partition sets each
window's pace, so the partitioner wants both: the largest lookahead and an even load.

The algorithm (`partition`; `frontier` gives every level it weighs):

1. Each unordered pair {a, b} gets the weight w = min(floor(a→b), floor(b→a)), where a link's
   floor (`min_delay_ms`) is the least delay it can give a message: its `delay_ms` and every
   step of its schedule, less the reach of its jitter, never below 0.
2. Single-linkage clustering: Kruskal's minimum spanning tree on w, merging the closest pairs
   first. For a threshold L, the *atoms* are the connected parts of the pairs with w < L (the
   tree's edges below L give the same parts); atoms must not be split, and any grouping of whole
   atoms has a lookahead >= L. Only the tree's distinct weights change the atoms, so they are
   the levels tried; a level must be > 0, so a zero-delay link (or a jitter that reaches 0)
   never crosses partitions. This is max-spacing k-clustering: its largest level with >= k
   atoms is the largest lookahead any k-grouping can have.
3. At each level the atoms are packed into k groups to make the heaviest group as light as
   possible: exactly (a search over all packings) up to `EXACT_ATOMS` atoms, else largest
   first into the lightest group, then moves and swaps out of the heaviest group while they
   lower it.
4. The balance of a grouping is its heaviest group's share over the mean share (1.0: even).
   The target is `max_imbalance`, or the best balance the finest level reaches if even that is
   worse (one node carrying 40% of the work cannot be split); the chosen grouping is the one of
   the highest level that meets the target. Its lookahead is then measured on the groups (it
   may exceed the level).

Deterministic: nodes are taken in name order and every tie goes by name, so the same topology
and loads give the same groups whatever the YAML's order. Fewer than k groups come back when the
topology has fewer nodes than k (one node each) or when zero-delay links leave fewer than k
atoms. `expected_load` and `scenario_load` estimate the load from a placement (the router's
picks on the placement's calibration traffic, and the dense steps of the tokens each node
homes); without a load every node weighs the same.

    from orchestrator.partitioner import partition
    p = partition(topology, 4)
    p.groups, p.lookahead_ms, p.shares, p.balance
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from moe.vocab import clip, is_number
from netem.spec import LinkSpec
from orchestrator.scenario.topology import Topology

__all__ = [
    "DEFAULT_MAX_IMBALANCE",
    "EXACT_ATOMS",
    "Partitioning",
    "expected_load",
    "frontier",
    "min_delay_ms",
    "pair_delays_ms",
    "partition",
    "scenario_load",
]

# The heaviest group may carry this much more than the mean before a shorter lookahead is
# preferred: a window's pace is its slowest partition's, so 1.25 gives up at most a fifth of
# the ideal speed-up for the longer windows.
DEFAULT_MAX_IMBALANCE = 1.25
EXACT_ATOMS = 10  # up to this many atoms the packing is searched exactly (Stirling S(10, k))
_EPS = 1e-9


@dataclass(frozen=True)
class Partitioning:
    """Groups of node names (each sorted by name, the groups by their first name), the
    lookahead in ms (the least floor delay between two groups; inf for one group), each
    group's share of the load (sums to 1) and the k that was asked."""

    groups: tuple[tuple[str, ...], ...]
    lookahead_ms: float
    shares: tuple[float, ...]
    k: int

    @property
    def balance(self) -> float:
        """The heaviest group's share over the mean share (1.0: even; the window's pace)."""
        return max(self.shares) * len(self.groups)

    def group_of(self, node: str) -> int:
        """Index of the group that holds `node`."""
        for i, group in enumerate(self.groups):
            if node in group:
                return i
        raise KeyError(f"unknown node {clip(node)}")

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "groups": [list(g) for g in self.groups],
                "lookahead_ms": None if math.isinf(self.lookahead_ms) else self.lookahead_ms,
                "shares": list(self.shares), "balance": self.balance}


@cache
def _jitter_reach(dist: str) -> float:
    """How many jitter_ms below delay_ms a draw can fall (netem.dist's tables)."""
    if dist == "uniform":
        return 1.0
    from netem.dist import SCALE, table

    return max(0.0, -min(table(dist)) / SCALE)


def min_delay_ms(spec: LinkSpec) -> float:
    """The least one-way delay `spec` can give a message: the lowest of its delay_ms and its
    schedule's step delays, less its jitter's reach (netem.dist.draw_delay_ms), never below 0.
    A conservative window may not be longer than this, whatever the draws turn out to be."""
    delays = [spec.delay_ms]
    if spec.schedule is not None:
        delays += [s.delay_ms for s in spec.schedule.steps if s.delay_ms is not None]
    low = min(delays)
    if spec.jitter_ms > 0:
        low -= spec.jitter_ms * _jitter_reach(spec.jitter_dist)
    return max(0.0, low)


def pair_delays_ms(topology: Topology) -> dict[tuple[str, str], float]:
    """(a, b) with a < b by name → the lower floor of a→b and b→a: the least time a message
    between the two takes, whichever way it goes."""
    out: dict[tuple[str, str], float] = {}
    for link in topology.links:
        key = (min(link.src, link.dst), max(link.src, link.dst))
        floor = min_delay_ms(link.spec)
        out[key] = min(floor, out.get(key, math.inf))
    return out


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: the number of partitions must be an integer >= 1, "
                         f"got {clip(k)}")
    return k


def _loads(names: Sequence[str], load: Mapping[str, float] | None) -> dict[str, float]:
    if load is None:
        return dict.fromkeys(names, 1.0)
    unknown = sorted(set(load) - set(names))
    if unknown:
        raise ValueError(f"load: unknown node {clip(unknown[0])} (nodes: {', '.join(names)})")
    missing = [n for n in names if n not in load]
    if missing:
        raise ValueError(f"load: no value for node {clip(missing[0])}; give every node one "
                         f"(0 for a node that does no work)")
    for name in names:
        value = load[name]
        if not is_number(value) or value < 0:
            raise ValueError(f"load: {name} must be a finite number >= 0, got {clip(value)}")
    out = {n: float(load[n]) for n in names}
    if sum(out.values()) <= 0:
        raise ValueError("load: the values sum to 0; at least one node needs work")
    return out


class _Atoms:
    """Union-find over the names, merged along tree edges below a level."""

    def __init__(self, names: Sequence[str]) -> None:
        self.parent = {n: n for n in names}

    def find(self, x: str) -> str:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: str, b: str) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        lo, hi = sorted((ra, rb))
        self.parent[hi] = lo
        return True


def _tree(names: Sequence[str], delays: Mapping[tuple[str, str], float]
          ) -> list[tuple[float, str, str]]:
    """Kruskal's minimum spanning tree on the pair delays: (w, a, b), lightest first."""
    uf = _Atoms(names)
    out = []
    for (a, b), w in sorted(delays.items(), key=lambda kv: (kv[1], kv[0])):
        if uf.union(a, b):
            out.append((w, a, b))
    return out


def _atoms_below(names: Sequence[str], tree: Sequence[tuple[float, str, str]], level: float
                 ) -> list[tuple[str, ...]]:
    """The parts joined by tree edges lighter than `level`, each sorted, by first name."""
    uf = _Atoms(names)
    for w, a, b in tree:
        if w < level:
            uf.union(a, b)
    parts: dict[str, list[str]] = {}
    for n in names:
        parts.setdefault(uf.find(n), []).append(n)
    return sorted(tuple(sorted(p)) for p in parts.values())


def _pack_exact(weights: Sequence[float], k: int) -> list[int]:
    """Bin of each item (heaviest first) that makes the heaviest of k non-empty bins lightest;
    the first such packing in search order (a new bin only after the used ones)."""
    best: list[Any] = [math.inf, None]
    bins = [0.0] * k
    assign = [0] * len(weights)
    n = len(weights)

    def search(i: int, used: int, top: float) -> None:
        if top >= best[0] - _EPS or n - i < k - used:
            return
        if i == n:
            best[0], best[1] = top, list(assign)
            return
        for b in range(min(used + 1, k)):
            bins[b] += weights[i]
            assign[i] = b
            search(i + 1, max(used, b + 1), max(top, bins[b]))
            bins[b] -= weights[i]

    search(0, 0, 0.0)
    return best[1]


def _pack_greedy(weights: Sequence[float], k: int) -> list[int]:
    """Largest first into the lightest bin (empty bins first), then moves and swaps out of the
    heaviest bin while they lower the heavier of the two bins they touch."""
    bins = [0.0] * k
    sizes = [0] * k
    assign = []
    for w in weights:
        b = min(range(k), key=lambda j: (sizes[j] > 0, bins[j], j))
        bins[b] += w
        sizes[b] += 1
        assign.append(b)
    for _ in range(4 * len(weights) * k):
        top = max(range(k), key=lambda j: (bins[j], -j))
        if not _improve(weights, assign, bins, sizes, top):
            break
    return assign


def _improve(weights: Sequence[float], assign: list[int], bins: list[float], sizes: list[int],
             top: int) -> bool:
    """One move or swap that lowers max(bins[top], bins[other]); False when none does."""
    mine = [i for i, b in enumerate(assign) if b == top]
    for other in sorted(range(len(bins)), key=lambda j: (bins[j], j)):
        if other == top:
            continue
        limit = max(bins[top], bins[other]) - _EPS
        if sizes[top] > 1:
            for i in mine:
                if max(bins[top] - weights[i], bins[other] + weights[i]) < limit:
                    _move(assign, bins, sizes, i, other, weights)
                    return True
        for i in mine:
            for j in (j for j, b in enumerate(assign) if b == other):
                d = weights[i] - weights[j]
                if d > 0 and max(bins[top] - d, bins[other] + d) < limit:
                    _move(assign, bins, sizes, i, other, weights)
                    _move(assign, bins, sizes, j, top, weights)
                    return True
    return False


def _move(assign: list[int], bins: list[float], sizes: list[int], i: int, to: int,
          weights: Sequence[float]) -> None:
    bins[assign[i]] -= weights[i]
    sizes[assign[i]] -= 1
    bins[to] += weights[i]
    sizes[to] += 1
    assign[i] = to


def _group(atoms: Sequence[tuple[str, ...]], loads: Mapping[str, float], k: int
           ) -> list[tuple[str, ...]]:
    """The atoms packed into k groups (see the module docstring, step 3)."""
    weight = {a: sum(loads[n] for n in a) for a in atoms}
    order = sorted(atoms, key=lambda a: (-weight[a], a))
    weights = [weight[a] for a in order]
    pack = _pack_exact if len(order) <= EXACT_ATOMS else _pack_greedy
    groups: list[list[str]] = [[] for _ in range(k)]
    for atom, b in zip(order, pack(weights, k), strict=True):
        groups[b].extend(atom)
    return sorted(tuple(sorted(g)) for g in groups)


def _result(groups: Sequence[tuple[str, ...]], loads: Mapping[str, float],
            delays: Mapping[tuple[str, str], float], k: int) -> Partitioning:
    where = {n: i for i, g in enumerate(groups) for n in g}
    lookahead = min((w for (a, b), w in delays.items() if where[a] != where[b]),
                    default=math.inf)
    total = sum(loads.values())
    shares = tuple(sum(loads[n] for n in g) / total for g in groups)
    return Partitioning(tuple(groups), lookahead, shares, k)


def frontier(topology: Topology, k: int, load: Mapping[str, float] | None = None
             ) -> tuple[Partitioning, ...]:
    """One grouping per level that leaves at least k atoms (module docstring, steps 1-3),
    the longest lookahead first: the trade between window length and balance that `partition`
    chooses from. A single grouping when k = 1, the mesh has one node, or no level > 0 exists."""
    k = _check_k(k)
    names = sorted(topology.names)
    loads = _loads(names, load)
    delays = pair_delays_ms(topology)
    tree = _tree(names, delays)
    levels = sorted({w for w, _, _ in tree if w > 0}, reverse=True)
    if k == 1 or not levels:
        return (_result([tuple(names)], loads, delays, k),)
    finest = _atoms_below(names, tree, levels[-1])
    width = min(k, len(finest))
    out = []
    for level in levels:
        atoms = _atoms_below(names, tree, level)
        if len(atoms) >= width:
            out.append(_result(_group(atoms, loads, width), loads, delays, k))
    return tuple(out)


def partition(topology: Topology, k: int, load: Mapping[str, float] | None = None, *,
              max_imbalance: float = DEFAULT_MAX_IMBALANCE) -> Partitioning:
    """The nodes in (at most) k partitions: the longest lookahead whose balance meets
    `max_imbalance`, or the finest level's balance where that is worse (module docstring).

    `load`: node → expected work (any unit, >= 0, every node given; `expected_load` estimates
    it from a placement); None: every node the same. ValueError for a k that is not an
    integer >= 1, a bad load or `max_imbalance` < 1 (inf: the longest lookahead, whatever the
    balance)."""
    if not is_number(max_imbalance, finite=False) or not max_imbalance >= 1:
        raise ValueError(f"max_imbalance: must be a number >= 1 (the heaviest partition's "
                         f"share over the mean), got {clip(max_imbalance)}")
    options = frontier(topology, k, load)
    target = max(max_imbalance, options[-1].balance)
    return next(p for p in options if p.balance <= target + _EPS)


def expected_load(result: Any, dense_weight: float | None = None) -> dict[str, float]:
    """Node → expected work per calibration token of a placement (an
    `orchestrator.placement.PlacementResult`): the expert rows the router sends it
    (`evaluate.simulate` on the placement's own traffic and router; under a second for 2,048
    tokens) plus the dense steps of the tokens it homes (its home share x layers x
    `dense_weight`). `dense_weight` None: top_k, one dense step weighs the rows it feeds, as in
    issue 51's stack samples (dense part 23% of the loop thread, experts 20%)."""
    from orchestrator.placement import simulate

    problem = result.problem
    weight = float(problem.top_k if dense_weight is None else dense_weight)
    out = {n: share * problem.layers * weight
           for n, share in zip(problem.names, problem.home_shares, strict=True)}
    for replica, rows in simulate(problem, result.replicas, problem.router).selections.items():
        out[replica.node] += rows
    return out


def scenario_load(scenario: Any, policy: str | None = None,
                  dense_weight: float | None = None) -> dict[str, float]:
    """`expected_load` of a scenario's placement (its `placement.policy`, or `policy`): the
    placement is computed as `moemesh run` computes it (seconds: it is the run's own setup)."""
    from orchestrator.placement import place, problem_from_scenario

    result = place(problem_from_scenario(scenario), policy or scenario.placement.policy)
    return expected_load(result, dense_weight)
