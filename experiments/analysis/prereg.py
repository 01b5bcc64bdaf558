"""A run's pre-registered claims judged on its rows, and what the report says about them.

The claims come from the scenario (`claims:`, orchestrator.scenario.claims) through run.json
(`claims`, `scenario_sha256`). Each is judged on the paired comparison of its two arms on its
metric (experiments.analysis.paired, the report's CI, seeded with the run's seed) by
`orchestrator.scenario.claims.judge`: the CI rules, never the p-value. A study judges the same
claims on its hierarchical CI across worlds (experiments.study.run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.scenario.claims import Claim, judge

from ..run.rows import TokenRow
from ..run.runmeta import RunMeta
from .paired import failed_charge, paired_compare

__all__ = ["claims_of", "judge_run", "prereg_lines"]


def claims_of(meta: RunMeta) -> tuple[Claim, ...]:
    """run.json's `claims` as Claims (none in a run recorded before them)."""
    raw = meta.claims
    try:
        return tuple(Claim(**c) for c in raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"run.json: field 'claims' is not a list of claims: {exc}") from None


def judge_run(meta: RunMeta, tokens: Mapping[str, Sequence[TokenRow]]
              ) -> list[dict[str, Any]]:
    """Per claim: the claim, the paired change and CI of its arms, and the verdict."""
    seed = meta.seed
    charge = failed_charge(*tokens.values())
    out = []
    for claim in claims_of(meta):
        if claim.policy not in tokens or claim.baseline not in tokens:
            out.append({"claim": claim.to_data(), "text": claim.text(), "change_pct": None,
                        "ci95_pct": [None, None], "verdict": "n/a (arm not run)"})
            continue
        c = paired_compare(claim.baseline, tokens[claim.baseline], claim.policy,
                           tokens[claim.policy], claim.metric, seed=seed, failed_at=charge)
        out.append({"claim": claim.to_data(), "text": claim.text(),
                    "change_pct": _num(c.change_pct),
                    "ci95_pct": [_num(c.ci_low_pct), _num(c.ci_high_pct)],
                    "verdict": judge(claim, c.ci_low_pct, c.ci_high_pct)})
    return out


def _num(x: float) -> float | None:
    return round(float(x), 4) if math.isfinite(x) else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def prereg_lines(meta: RunMeta, tokens: Mapping[str, Sequence[TokenRow]]
                 ) -> list[str]:
    """The report's "Pre-registered claims" section (with the scenario file's sha256)."""
    sha = meta.scenario_sha256
    where = (f"The scenario file's sha256 is `{sha}` (run.json `scenario_sha256`): a scenario "
             f"edited after its results were seen has another." if sha else
             "The scenario was not read from a file (or the run predates the record): no "
             "sha256 of it is known.")
    lines = ["## Pre-registered claims", "", where, ""]
    judged = judge_run(meta, tokens)
    if not judged:
        return [*lines, "This scenario states no claims (`claims:`), so nothing here was "
                        "registered before the run: every comparison above is exploratory, "
                        "and which of them matter was chosen by whoever reads it.", ""]
    lines += ["The claims the scenario stated before it was run (`claims:`), judged on the "
              "paired 95% CI of their arms (the CI rules, not p): held = the whole interval "
              "beyond the minimum effect in the claimed direction; reversed = the whole "
              "interval on the other side of 0; not held = anything else.", "",
              "| claim | change | paired 95% CI | verdict |", "|---|---|---|---|"]
    for j in judged:
        lo, hi = j["ci95_pct"]
        ci = "–" if lo is None else f"{lo:+.1f}% .. {hi:+.1f}%"
        lines.append(f"| {j['text']} | {_pct(j['change_pct'])} | {ci} | {j['verdict']} |")
    return [*lines, ""]
