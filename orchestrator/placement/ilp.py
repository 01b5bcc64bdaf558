"""The exact placement for small instances: a mixed-integer program of the separable cost.

Same objective and rules as the greedy policies are measured on (`evaluate.separable_cost`,
`base` rules), solved by HiGHS through `scipy.optimize.milp`, so the greedy's optimality gap
is a number, not a guess. It is a capacitated facility-location problem:

    y[n,l,e,v,t] ∈ {0,1}   replica of expert (l,e) in variant v, tier t on node n
    x[h,l,e,n,v,t] ∈ [0,1]  share of home h's uses of (l,e) that replica serves
    z[n,v] ∈ {0,1}          node n holds some CPU-tier expert of variant v

    minimise   Σ demand[h,l,e] · (cost[h,n,v,t] + price[l,e,v]) · x[h,l,e,n,v,t]
    subject to Σ_{n,v,t} x[h,l,e,·] = 1 for every (h,l,e) with demand;  x ≤ y
               Σ_{n,t} y[n,l,e,fp16,t] ≥ 1        (a full-precision replica of every expert)
               Σ_t y[n,l,e,v,t] ≤ 1                (one tier per node and precision)
               GPU tier + bytes(v)·z[n,v] ≤ GPU memory, for every v;  y[n,l,e,v,cpu] ≤ z[n,v]
               CPU tier ≤ CPU memory;  Σ bytes · y ≤ redundancy budget

Given y, the best x sends each use to its cheapest replica, so the optimum equals
`separable_cost` of the optimal placement. Sizes grow as homes x nodes x experts x variants x 2;
a few thousand experts-times-nodes solve in seconds, more may hit the time limit (the result
then carries HiGHS's bound, and the gap is reported against it).

`max_coverage` solves a second program: the most local group coverage (`coverage.py`) any
placement reaches within the memory budget, so that a coverage target can be told unreachable
rather than missed. Tiers are ignored (coverage counts either), so a node's GPU and CPU memory
pool; every other rule stays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from moe.vocab import FULL_PRECISION, TIERS
from router.types import Replica

from .coverage import admits
from .evaluate import cost_tables
from .problem import PlacementError, PlacementProblem

__all__ = ["CoverageOptimum", "IlpResult", "gap", "max_coverage", "solve"]

MAX_VARIABLES = 400_000
_STATUS = {0: "optimal", 1: "time limit"}  # scipy.optimize.milp's status codes


@dataclass(frozen=True)
class IlpResult:
    status: str  # "optimal", "time limit" (best found so far), ...
    optimal: bool
    objective_ms: float  # separable cost of `replicas` (ms per token)
    bound_ms: float  # HiGHS's lower bound (== objective when optimal)
    replicas: tuple[Replica, ...]
    solve_s: float
    variables: int


class _Rows:
    """Sparse constraint rows built one at a time."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        row = len(self.lo)
        self.r += [row] * len(cols)
        self.c += cols
        self.v += vals
        self.lo.append(lo)
        self.hi.append(hi)

    def constraint(self, width: int) -> LinearConstraint:
        a = coo_array((self.v, (self.r, self.c)), shape=(len(self.lo), width)).tocsr()
        return LinearConstraint(a, np.array(self.lo), np.array(self.hi))


def solve(problem: PlacementProblem, time_limit_s: float = 60.0) -> IlpResult:
    """The placement that minimises the separable cost (see the module docstring)."""
    tables = cost_tables(problem)
    p, variants = problem, tables.variants
    N, L, E, V, T = p.nodes, p.layers, p.experts, len(variants), len(TIERS)
    size = [p.bytes_of(v) for v in variants]
    demanded = [(h, layer, e) for h in range(N) for layer in range(L) for e in range(E)
                if tables.demand[h, layer, e] > 0]
    ny = N * L * E * V * T
    nx = len(demanded) * N * V * T
    nz = N * V
    width = ny + nx + nz
    if width > MAX_VARIABLES:
        raise PlacementError(f"the ILP would have {width} variables (limit {MAX_VARIABLES}): "
                             "use it on small instances only")

    def y(n: int, layer: int, e: int, v: int, t: int) -> int:
        return (((n * L + layer) * E + e) * V + v) * T + t

    def z(n: int, v: int) -> int:
        return ny + nx + n * V + v

    cost = np.zeros(width)
    rows = _Rows()
    for i, (h, layer, e) in enumerate(demanded):
        c = tables.cost(layer, e)[h]  # [n, v, t]
        base = ny + i * N * V * T
        cols = list(range(base, base + N * V * T))
        cost[base:base + N * V * T] = tables.demand[h, layer, e] * c.reshape(-1)
        rows.add(cols, [1.0] * len(cols), 1.0, 1.0)
        for n in range(N):
            for v in range(V):
                for t in range(T):
                    xi = base + (n * V + v) * T + t
                    rows.add([xi, y(n, layer, e, v, t)], [1.0, -1.0], -np.inf, 0.0)
    fp = variants.index(FULL_PRECISION)
    gpu, cpu = TIERS.index("gpu"), TIERS.index("cpu")
    for layer in range(L):
        for e in range(E):
            rows.add([y(n, layer, e, fp, t) for n in range(N) for t in range(T)],
                     [1.0] * (N * T), 1.0, np.inf)
            for n in range(N):
                for v in range(V):
                    rows.add([y(n, layer, e, v, t) for t in range(T)], [1.0] * T, 0.0, 1.0)
                    rows.add([y(n, layer, e, v, cpu), z(n, v)], [1.0, -1.0], -np.inf, 0.0)
    for n in range(N):
        gpu_cols = [y(n, layer, e, v, gpu) for layer in range(L) for e in range(E)
                    for v in range(V)]
        sizes = [float(size[v]) for _ in range(L) for _ in range(E) for v in range(V)]
        for v in range(V):
            rows.add([*gpu_cols, z(n, v)], [*sizes, float(size[v])], -np.inf,
                     float(p.gpu_bytes[n]))
        rows.add([y(n, layer, e, v, cpu) for layer in range(L) for e in range(E)
                  for v in range(V)], sizes, -np.inf, float(p.cpu_bytes[n]))
    rows.add(list(range(ny)), [float(size[(i // T) % V]) for i in range(ny)], -np.inf,
             float(p.budget_bytes))
    integrality = np.zeros(width)
    integrality[:ny] = 1
    integrality[ny + nx:] = 1
    res, elapsed = _solve(cost, rows, integrality, time_limit_s, "the ILP")
    replicas = _chosen(p, variants, res.x[:ny])
    bound = getattr(res, "mip_dual_bound", None)
    optimal = res.status == 0
    objective = float(res.fun)
    return IlpResult(
        status=_STATUS.get(res.status, str(res.message)), optimal=optimal,
        objective_ms=objective,
        bound_ms=objective if optimal or bound is None else float(bound),
        replicas=tuple(replicas), solve_s=elapsed, variables=width)


def _solve(cost: np.ndarray, rows: _Rows, integrality: np.ndarray, time_limit_s: float,
           what: str) -> tuple[Any, float]:
    """HiGHS on 0/1-bounded variables: (its result, seconds); a clear error when it found no
    placement at all."""
    started = time.perf_counter()
    res = milp(cost, constraints=[rows.constraint(len(cost))], integrality=integrality,
               bounds=Bounds(0.0, 1.0),
               options={"time_limit": float(time_limit_s), "disp": False})
    elapsed = time.perf_counter() - started
    if res.x is None:
        raise PlacementError(f"{what} found no placement ({res.message}); the memory may be "
                             "too small for one fp16 copy of every expert")
    return res, elapsed


def _chosen(p: PlacementProblem, variants: tuple[str, ...], y: np.ndarray) -> list[Replica]:
    """The replicas the solution's y[n, l, e, v, t] (flat, in that order) chose."""
    shape = (p.nodes, p.layers, p.experts, len(variants), len(TIERS))
    return [Replica(int(layer), int(e), p.names[n], variants[v], TIERS[t])
            for n, layer, e, v, t in zip(*np.nonzero(y.reshape(shape) > 0.5), strict=True)]


def gap(greedy_ms: float, result: IlpResult) -> float:
    """(greedy − optimum) / optimum; against the bound when the optimum is not proven (then it
    is an upper limit on the true gap)."""
    best = result.objective_ms if result.optimal else result.bound_ms
    if best <= 0:
        return 0.0 if greedy_ms <= 0 else float("inf")
    return (greedy_ms - best) / best


@dataclass(frozen=True)
class CoverageOptimum:
    coverage: float  # the best placement found (== bound when optimal)
    bound: float  # HiGHS's upper bound: no placement covers more
    optimal: bool
    solve_s: float


def max_coverage(problem: PlacementProblem, time_limit_s: float = 60.0,
                 within_budget: bool = True) -> CoverageOptimum:
    """The most local group coverage any placement of `problem` reaches (module docstring).

    y[n,l,x,v] ∈ {0,1} holds a replica; for each home h and expert (l,e) used there, the
    replicas that could serve e (e itself or a substitute, in any variant) sorted by quality
    price p_1 < p_2 < ...; c_j ∈ [0,1] is "some replica at price <= p_j is on h", bounded by
    the sum of those y. The objective sums c_j x (the uses p_j admits − those p_{j+1} admits),
    which for a whole placement is the uses its cheapest local replica admits. A use of gate
    weight w is admitted at price p when w x p <= budget / layers (`coverage.py`); with
    `within_budget=False` every replica admits every use (the budget aside)."""
    p, q = problem, problem.quality
    N, L, E, V = p.nodes, p.layers, p.experts, len(p.variants)
    homes, layer_of, expert_of, weight = p.uses()
    spread = p.settings.budget / L if within_budget else np.inf
    ny = N * L * E * V

    def y(n: int, layer: int, x: int, v: int) -> int:
        return ((n * L + layer) * E + x) * V + v

    rows = _Rows()
    gains: list[float] = []  # per c column, after the y columns
    for layer in range(L):
        usable = {e: [(x, v, price) for x, pen in ((e, 0.0), *q.substitutes(layer, e))
                      for v in range(V)
                      if np.isfinite(price := q.quant_penalty(layer, x, p.variants[v]) + pen)]
                  for e in range(E)}  # (replica's expert, variant, price) that may serve e
        levels = {e: sorted({price for _, _, price in usable[e]}) for e in range(E)}
        for h in range(N):
            here = (homes == h) & (layer_of == layer)
            for e in range(E):
                w = weight[here & (expert_of == e)]
                count = [int(np.sum(admits(w, price, spread))) for price in levels[e]] + [0]
                for j, price in enumerate(levels[e]):
                    if count[j] > count[j + 1]:
                        cols = [y(h, layer, x, v) for x, v, c in usable[e] if c <= price]
                        rows.add([ny + len(gains), *cols], [1.0] + [-1.0] * len(cols),
                                 -np.inf, 0.0)
                        gains.append((count[j] - count[j + 1]) / len(expert_of))
    width = ny + len(gains)
    size = [float(p.bytes_of(v)) for v in p.variants]
    fp = p.variants.index(FULL_PRECISION)
    for layer in range(L):
        for x in range(E):
            rows.add([y(n, layer, x, fp) for n in range(N)], [1.0] * N, 1.0, np.inf)
    per_node = [size[v] for _ in range(L * E) for v in range(V)]
    for n in range(N):
        rows.add(list(range(y(n, 0, 0, 0), y(n, 0, 0, 0) + L * E * V)), per_node, -np.inf,
                 float(p.gpu_bytes[n] + p.cpu_bytes[n]))
    rows.add(list(range(ny)), per_node * N, -np.inf, float(p.budget_bytes))
    cost = np.zeros(width)
    cost[ny:] = -np.array(gains)
    integrality = np.zeros(width)
    integrality[:ny] = 1
    res, elapsed = _solve(cost, rows, integrality, time_limit_s, "the coverage program")
    best = float(-res.fun)
    bound = getattr(res, "mip_dual_bound", None)
    optimal = res.status == 0
    return CoverageOptimum(best, best if optimal or bound is None else float(-bound), optimal,
                           elapsed)
