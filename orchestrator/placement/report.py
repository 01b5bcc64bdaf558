"""The text `moemesh placement` prints: the placement, memory per node and tier, replicas per
expert, the expected cost, and (optionally) the ILP's optimum and the greedy's gap."""

from __future__ import annotations

from collections import Counter
from typing import Any

from moe.vocab import TIER_MARK, VARIANT_SPECS

from .base import PlacementResult
from .edgeshard import stage_runs

__all__ = ["render"]

VARIANT_MARK = {name: v.mark for name, v in VARIANT_SPECS.items()}


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def render(result: PlacementResult, scenario: str = "", ilp: Any = None,
           ilp_cost_ms: float | None = None, coverage: Any = None) -> str:
    p, notes = result.problem, result.notes
    out = [f"placement {result.policy}" + (f" for {scenario}" if scenario else "")
           + f": {p.model} ({p.layers} MoE layers x {p.experts} experts, top-{p.top_k}), "
           f"{p.nodes} nodes",
           f"  redundancy {p.redundancy:g} (budget {_size(p.budget_bytes)}; one fp16 expert "
           f"{_size(p.bytes_of('fp16'))}), variants {'/'.join(p.variants)}",
           f"  calibration: {p.tokens} tokens ({p.traffic_source}); quality tables "
           f"{p.quality_source}; router {notes.get('router', '?')}",
           "",
           f"expected cost: {result.expected_cost_ms:.4g} ms per token over all MoE layers "
           f"(router's plans on calibration traffic; empty queues, no GPU cache)",
           f"  quality spent {100 * notes.get('quality_per_token', 0.0):.3g}% per token "
           f"(budget {100 * p.settings.budget:g}%), experts run at home "
           f"{100 * notes.get('local_share', 0.0):.1f}%, network "
           f"{_size(notes.get('traffic_bytes_per_token', 0.0))} per token",
           f"  separable cost (each expert alone at its cheapest replica): "
           f"{result.separable_cost_ms:.4g} ms per token"]
    for i, (stages, ms) in enumerate(zip(notes.get("pipelines", ()),
                                         notes.get("pipeline_predicted_ms", ()), strict=False)):
        out.append(f"  pipeline {i} (dense: pipeline; {ms:.4g} ms per decode token from the "
                   f"homes and back): {' → '.join(stage_runs(stages))}")
    extra = {k: v for k, v in notes.items() if k in ("local_group_coverage", "groups",
                                                      "dropped", "quantized_replicas")}
    if "local_group_coverage" in extra:
        groups = f"; {extra['groups']} similarity groups" if "groups" in extra else ""
        out.append(f"  local group coverage {100 * extra['local_group_coverage']:.1f}% (expert "
                   f"uses whose expert or a substitute within the budget is on the home "
                   f"node{groups})")
    if coverage is not None:
        how = ("optimal" if coverage.optimal
               else f"best found; no placement covers more than {100 * coverage.bound:.1f}%")
        out.append(f"  the most any placement covers within this memory: "
                   f"{100 * coverage.coverage:.1f}% (MILP, {how}, {coverage.solve_s:.1f} s)")
    if "dropped" in extra:
        out.append(f"  {extra['quantized_replicas']} low-precision replicas; {extra['dropped']} "
                   f"replicas the router never chose were dropped")
    if ilp is not None:
        from .ilp import gap

        status = "optimal" if ilp.optimal else f"{ilp.status} (bound {ilp.bound_ms:.4g} ms)"
        out += ["", f"exact ILP (HiGHS, {ilp.variables} variables, {ilp.solve_s:.1f} s): "
                f"{ilp.objective_ms:.4g} ms separable, {status}",
                f"  greedy {result.policy} gap: {100 * gap(result.separable_cost_ms, ilp):.2f}%"
                + ("" if ilp.optimal else " (against the bound: at most this)")]
        if ilp_cost_ms is not None:
            out.append(f"  the ILP's placement under the router: {ilp_cost_ms:.4g} ms per token "
                       f"(greedy {result.expected_cost_ms:.4g})")
    rows = [["node", "GPU used / cap", "CPU used / cap", "replicas gpu", "cpu"]]
    counts = {n: Counter() for n in p.names}
    for r in result.replicas:
        counts[r.node][r.tier] += 1
    for name, mem in result.memory().items():
        rows.append([name, f"{_size(mem['gpu_used_gb'] * 1e9)} / {_size(mem['gpu_cap_gb'] * 1e9)}",
                     f"{_size(mem['cpu_used_gb'] * 1e9)} / {_size(mem['cpu_cap_gb'] * 1e9)}",
                     str(counts[name]["gpu"]), str(counts[name]["cpu"])])
    out += ["", "memory per node and tier:", *("  " + line for line in _table(rows))]
    hist = Counter(int(c) for c in result.replica_counts().reshape(-1))
    spread = ", ".join(f"{k} replica{'s' if k != 1 else ''}: {v} experts"
                       for k, v in sorted(hist.items()))
    out += ["", f"replicas per expert: {spread}",
            "  where (node:tier+bits, g = GPU, c = CPU; e.g. edge1:g16 = fp16 in edge1's GPU):"]
    by_expert: dict[tuple[int, int], list[str]] = {}
    for r in result.replicas:
        by_expert.setdefault((r.layer, r.expert), []).append(
            f"{r.node}:{TIER_MARK[r.tier]}{VARIANT_MARK[r.variant]}")
    for layer in range(p.layers):
        for e in range(p.experts):
            held = by_expert.get((layer, e), [])
            out.append(f"  L{layer} E{e:<3d} {len(held)}  {' '.join(held)}")
    return "\n".join(out)
