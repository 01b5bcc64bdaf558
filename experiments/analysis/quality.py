"""Quality on the identical token set: every policy's NLL over the SAME held-out positions.

The runner scores the same held-out windows, at the same home nodes, through every policy
and through `exact` (`/v1/score`); each answer says which positions failed (no MoE output at
some layer) and each position's NLL. A position that failed under ANY policy (exact
included) is left out of EVERY policy's average and of exact's: otherwise a policy that
fails on hard positions would look better than exact on an easier token set. Each policy's
own failures are counted (`scoring_failed_tokens`) and shown; the run is then not faithful.

Runs recorded before the per-position answer have only each policy's mean NLL: when no
position failed anywhere those means are over the identical set and are used; otherwise the
delta is not comparable and is given as none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["QualitySet", "identical_set"]


@dataclass(frozen=True)
class QualitySet:
    """Every scored label's NLL over the common positions, and what was left out."""

    nll: dict[str, float] = field(default_factory=dict)  # label → mean NLL (nats/token)
    failed: dict[str, int] = field(default_factory=dict)  # label → its own failed positions
    scored: int = 0  # positions every label completed (the common set)
    excluded: int = 0  # positions left out because they failed under some label
    comparable: bool = True  # False: failures without per-position data (an old run)
    # label → its per-position NLL differences from exact over the common set (nats), in
    # window order; only with per-position data. What `se` and a study's resampling
    # (experiments.study.run.quality_effect) are drawn from
    diffs: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def se(self) -> dict[str, float]:
        """label → standard error (nats) of its mean difference from exact. One position's
        change under quantization varies far more than its mean (tiny-moe int4: sd 0.15 nats,
        mean 0.0014), so a few hundred positions cannot resolve a delta of a fraction of a
        percent: see delta_se_pct."""
        return {k: _standard_error(d) for k, d in self.diffs.items() if len(d) > 1}

    def delta_pct(self, label: str) -> float:
        """Perplexity change of `label` against exact, in % (nan when not comparable)."""
        if not self.comparable or label not in self.nll or "exact" not in self.nll:
            return math.nan
        a, b = self.nll["exact"], self.nll[label]
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan
        return 100.0 * (math.exp(b - a) - 1.0)

    def delta_se_pct(self, label: str) -> float:
        """Standard error of `delta_pct(label)`, in percentage points (nan when unknown)."""
        se = self.se.get(label, math.nan)
        if not math.isfinite(se) or "exact" not in self.nll or label not in self.nll:
            return math.nan
        return 100.0 * math.exp(self.nll[label] - self.nll["exact"]) * se

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())


def _failed_of(entry: Mapping[str, Any]) -> int:
    windows = entry.get("windows") or ()
    if windows:
        return sum(int(w.get("failed_tokens") or 0) for w in windows)
    return int(entry.get("failed_tokens") or 0)


def identical_set(quality: Mapping[str, Any]) -> QualitySet:
    """The common-set NLL of every label in run.json's `quality` (see the module docstring)."""
    labels = [k for k, v in quality.items() if isinstance(v, Mapping)]
    if not labels:
        return QualitySet()
    failed = {k: _failed_of(quality[k]) for k in labels}
    windows = {k: list(quality[k].get("windows") or ()) for k in labels}
    shapes = {tuple(len(w.get("token_nll") or ()) for w in windows[k]) for k in labels}
    per_position = (len(shapes) == 1 and all(
        w.get("token_nll") is not None and w.get("failed_positions") is not None
        for k in labels for w in windows[k]) and bool(next(iter(shapes))))
    if not per_position:
        ok = all(n == 0 for n in failed.values())
        nll = {k: (float(quality[k]["nll"]) if quality[k].get("nll") is not None else math.nan)
               for k in labels}
        scored = int(quality[labels[0]].get("tokens") or 0) if ok else 0
        return QualitySet(nll, failed, scored, 0, comparable=ok)
    lengths = next(iter(shapes))
    sums = dict.fromkeys(labels, 0.0)
    diffs: dict[str, list[float]] = {k: [] for k in labels}
    scored = excluded = 0
    for w, length in enumerate(lengths):
        bad: set[int] = set()
        for k in labels:
            win = windows[k][w]
            bad.update(int(i) for i in win["failed_positions"])
            bad.update(i for i, v in enumerate(win["token_nll"])
                       if v is None or not math.isfinite(float(v)))
        keep = [i for i in range(length) if i not in bad]
        excluded += length - len(keep)
        scored += len(keep)
        for k in labels:
            values = windows[k][w]["token_nll"]
            sums[k] += sum(float(values[i]) for i in keep)
            if "exact" in windows:
                ref = windows["exact"][w]["token_nll"]
                diffs[k] += [float(values[i]) - float(ref[i]) for i in keep]
    nll = {k: (sums[k] / scored if scored else math.nan) for k in labels}
    return QualitySet(nll, failed, scored, excluded, comparable=True,
                      diffs={k: tuple(d) for k, d in diffs.items() if d})


def _standard_error(values: Sequence[float]) -> float:
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
