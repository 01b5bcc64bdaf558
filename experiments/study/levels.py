"""Where experts ran, across a study's worlds: levels of one arm, not changes between two.

Some of the papers' claims are levels, not comparisons: HetRoute's "local GPU exact is the
largest share of executions" (46%) and OrderMoE's "83% of executions on the home node". In
one run they are a share of that run's expert executions (experiments.reproduce.papers); a study
reads them in every world so they rest on more than one topology:

* per world and arm: the share (%) of the measured tokens' expert executions that were
  local exact (`local_exact`, the run report's mix) or on the home node in any form
  (`local`), its 95% CI with the requests resampled, and the mix's largest category;
* pooled: the median, the mean with the same hierarchical CI as the comparisons
  (experiments.study.run.hierarchical_ci: topologies, then each world's requests), and for
  `local_exact` the share of worlds where it is the largest category.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from router.records import MIX_KEYS

from ..analysis.metrics import BOOTSTRAP

__all__ = ["LEVELS", "level_in_world", "pool_level"]

LEVELS = ("local_exact", "local")  # TokenRow columns counted against all executions


def level_in_world(tokens: Sequence[Any], level: str, seed: int,
                   resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """One arm's `level` in one world: share %, CI (requests resampled), requests, the
    replicates and the mix's largest category."""
    done = [t for t in tokens if not t.warmup and t.ok]
    per_request: dict[tuple[int, int], list[int]] = {}
    mix = dict.fromkeys(MIX_KEYS, 0)
    for t in done:
        kinds = t.mix()
        hit = per_request.setdefault((t.rep, t.request), [0, 0])
        hit[0] += getattr(t, level)
        hit[1] += sum(kinds.values())
        for k, v in kinds.items():
            mix[k] += v
    counts = np.array(list(per_request.values()), dtype=float).reshape(-1, 2)
    if not counts[:, 1].sum():
        return {"value_pct": math.nan, "ci95_pct": (math.nan, math.nan), "requests": 0,
                "replicates": np.array([]), "largest": None}
    rng = np.random.default_rng([seed, 0x1E7E1])
    picks = rng.integers(0, len(counts), size=(resamples, len(counts)))
    sums = counts[picks].sum(axis=1)
    reps = 100.0 * sums[:, 0] / np.maximum(sums[:, 1], 1.0)
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return {"value_pct": float(100.0 * counts[:, 0].sum() / counts[:, 1].sum()),
            "ci95_pct": (float(lo), float(hi)), "requests": len(counts), "replicates": reps,
            "largest": max(mix, key=lambda k: mix[k])}


def pool_level(policy: str, level: str, per_world: Sequence[Mapping[str, Any]],
               clusters: Sequence[int], *, seed: int) -> dict[str, Any]:
    """The pooled figures of one arm's level (module docstring)."""
    from .run import _num, hierarchical_ci

    values = [w["value_pct"] for w in per_world]
    finite = [v for v in values if math.isfinite(v)]
    mean, lo, hi = hierarchical_ci(values, [w["replicates"] for w in per_world], clusters,
                                   seed=seed)
    largest = [w["largest"] for w in per_world if w["largest"] is not None]
    return {
        "policy": policy, "level": level,
        "median_pct": _num(float(np.median(finite)) if finite else math.nan),
        "mean_pct": _num(mean), "hier_ci95_pct": [_num(lo), _num(hi)],
        "worlds": len(finite),
        "share_largest": (sum(k == level for k in largest) / len(largest)
                          if level in MIX_KEYS and largest else None),
        "per_world": [{"world": w["world"], "value_pct": _num(w["value_pct"]),
                       "ci95_pct": [_num(w["ci95_pct"][0]), _num(w["ci95_pct"][1])],
                       "largest": w["largest"]} for w in per_world],
    }
