"""Capacity across a study's worlds: `moemesh study SCENARIO --capacity`.

Each world climbs the capacity ladder (experiments.capacity: every arm at each load, the
highest load within the SLO and its throughput, the 95% bracket `[sure_load, sure_miss)`) in
`OUT/worlds/<world>/`. Then, per pair of arms (each arm against every earlier one in the
order given, or against `--baseline` alone):

* per world: the ratio of the policy's max throughput at the SLO to the baseline's (the
  papers' "2.13x tokens/s at the SLO"; only where both passed a load), whether its capacity
  is higher or lower (a policy that passed no load counts as 0), and whether it is
  *surely* higher (its `sure_load` at or above the baseline's `sure_miss`: the brackets do
  not overlap);
* pooled: the median ratio and the geometric mean with a 95% CI from the topologies
  resampled (experiments.study.run.hierarchical_ci on log ratios, a world's point ratio in every
  resample). Within a world the capacity is a ladder step with its bracket, not a figure with
  a bootstrap, so the CI covers which world one lands in, not the ladder's coarseness: the
  "surely higher" count is the within-world reading.

A world where either passed no load has no ratio: it counts in "higher" or "lower" (or
neither) and is left out of the ratio's mean and median, which therefore describe only the
worlds where both passed; read them beside the counts. Exploratory: no claim metric is a
capacity, so the verdicts are read against the papers by hand.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .worlds import World

__all__ = ["analyse_capacity", "capacity_pairs", "pool_ratio", "world_ratio"]


def capacity_pairs(labels: Sequence[str], baseline: str | None = None
                   ) -> list[tuple[str, str]]:
    """(policy, baseline) pairs: each arm against `baseline`, else against every earlier arm."""
    if baseline is not None:
        if baseline not in labels:
            raise ValueError(f"--baseline: no arm {baseline!r} (arms: {', '.join(labels)})")
        return [(p, baseline) for p in labels if p != baseline]
    return [(p, b) for i, p in enumerate(labels) for b in labels[:i]]


def world_ratio(caps: Mapping[str, Mapping[str, Any]], policy: str, baseline: str
                ) -> dict[str, Any]:
    """One world's reading of `policy` against `baseline` from capacity.json's `capacity`."""
    mine, theirs = caps.get(policy), caps.get(baseline)
    if mine is None or theirs is None:
        return {"ratio": None, "higher": None, "lower": None, "surely_higher": None,
                "note": "not run"}
    tp, tb = mine["throughput_tok_s"], theirs["throughput_tok_s"]
    ratio = tp / tb if tp is not None and tb else None
    note = ("baseline passed no load" if tb is None and tp is not None
            else "neither passed a load" if tb is None else
            "policy passed no load" if tp is None else "")
    surely = (mine["sure_load"] is not None and theirs["sure_miss"] is not None
              and mine["sure_load"] >= theirs["sure_miss"])
    return {"ratio": ratio, "higher": (mine["load"] or 0.0) > (theirs["load"] or 0.0),
            "lower": (mine["load"] or 0.0) < (theirs["load"] or 0.0),
            "surely_higher": surely, "note": note,
            "policy_load": mine["load"], "baseline_load": theirs["load"],
            "policy_tok_s": tp, "baseline_tok_s": tb}


def pool_ratio(policy: str, baseline: str, per_world: Sequence[Mapping[str, Any]],
               clusters: Sequence[int], *, seed: int) -> dict[str, Any]:
    """The pooled figures of one pair (module docstring)."""
    from .run import _num, hierarchical_ci

    logs = [math.log(w["ratio"]) if w["ratio"] else math.nan for w in per_world]
    mean, lo, hi = hierarchical_ci(logs, [np.array([]) for _ in per_world], clusters,
                                   seed=seed)
    finite = [w["ratio"] for w in per_world if w["ratio"]]
    judged = [w for w in per_world if w["higher"] is not None]
    return {
        "policy": policy, "baseline": baseline, "metric": "max_throughput_at_slo",
        "median_ratio": _num(float(np.median(finite)) if finite else math.nan),
        "geomean_ratio": _num(math.exp(mean) if math.isfinite(mean) else math.nan),
        "ci95_ratio": [_num(math.exp(lo) if math.isfinite(lo) else math.nan),
                       _num(math.exp(hi) if math.isfinite(hi) else math.nan)],
        "worlds": len(judged), "worlds_with_ratio": len(finite),
        "share_higher": sum(bool(w["higher"]) for w in judged) / len(judged) if judged else None,
        "share_lower": sum(bool(w["lower"]) for w in judged) / len(judged) if judged else None,
        "share_surely_higher": (sum(bool(w["surely_higher"]) for w in judged) / len(judged)
                                if judged else None),
        "per_world": [{k: (_num(v) if isinstance(v, float) else v) for k, v in w.items()}
                      for w in per_world],
    }


def analyse_capacity(out: Path, worlds: Sequence[World], pairs: Sequence[tuple[str, str]],
                     *, study_seed: int, meta: Mapping[str, Any]) -> dict[str, Any]:
    """study.json's content of a capacity study, from the worlds' capacity.json (no rerun)."""
    per_pair: list[list[dict[str, Any]]] = [[] for _ in pairs]
    world_info, capacities = [], {}
    for world in worlds:
        folder = out / "worlds" / world.name
        data = json.loads((folder / "capacity.json").read_text())
        caps = data["capacity"]
        capacities[world.name] = caps
        world_info.append({**world.to_json(), "folder": f"worlds/{world.name}",
                           "wall_s": data.get("wall_s"), "commit": _commit(folder, data),
                           "faithful": all(p.get("faithful", True) for p in data["points"]),
                           "slo_ms": data["slo_ms"], "target": data["target"],
                           "unit": data["unit"]})
        for i, (policy, base) in enumerate(pairs):
            per_pair[i].append({"world": world.name, **world_ratio(caps, policy, base)})
    clusters = [w.topology for w in worlds]
    return {**meta, "study_seed": study_seed, "kind": "capacity", "worlds": world_info,
            "capacity": capacities, "comparisons": [],
            "capacity_comparisons": [pool_ratio(p, b, per_pair[i], clusters, seed=study_seed)
                                     for i, (p, b) in enumerate(pairs)]}


def _commit(folder: Path, data: Mapping[str, Any]) -> str | None:
    """The code's commit the world's first load ran at (its run.json), if it says."""
    try:
        first = folder / data["points"][0]["folder"] / "run.json"
        return json.loads(first.read_text()).get("host", {}).get("commit")
    except (OSError, ValueError, IndexError, KeyError):
        return None
