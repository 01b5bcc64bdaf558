"""Pre-registered claims: what a scenario says its arms will show, written before it is run.

A scenario may list its claims (docs/contracts.md, "claims"):

    claims:
      - {metric: mean_latency, policy: hetroute, baseline: greedy, direction: lower}
      - {metric: traffic, policy: hetroute, baseline: greedy, direction: lower,
         min_effect_pct: 5}

`metric` is one of the paired metrics (experiments.analysis.paired: mean_latency, p99_latency, ttft,
decode_latency, traffic); `policy` and `baseline` are arm labels of the scenario;
`direction` is lower or higher (of policy against baseline); `min_effect_pct` (default 0)
is the smallest change, in %, that counts. The report and a study judge exactly these claims
(`judge`), so what a scenario set out to show cannot be chosen after the results are seen;
the scenario file's sha256 in run.json and the report makes a later edit visible.

Judged on a 95% CI of the change in %: `held` when the whole interval is beyond the minimum
effect in the claimed direction, `reversed` when the whole interval is on the other side of 0,
`not held` otherwise (and `n/a` when there is no interval).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moe.vocab import is_number
from orchestrator.scenario.yamlio import Loc, describe

__all__ = ["CLAIM_METRICS", "DIRECTIONS", "Claim", "check_labels", "judge", "read_claims"]

# experiments.analysis.paired.METRICS, repeated here so that orchestrator does not import
# experiments (a test checks the two agree)
CLAIM_METRICS = ("mean_latency", "p99_latency", "ttft", "decode_latency", "traffic")
DIRECTIONS = ("lower", "higher")
_KEYS = ("metric", "policy", "baseline", "direction", "min_effect_pct")
HELD, NOT_HELD, REVERSED, NA = "held", "not held", "reversed", "n/a"


@dataclass(frozen=True)
class Claim:
    """`policy` is `direction` than `baseline` on `metric` by more than `min_effect_pct` %."""

    metric: str
    policy: str
    baseline: str
    direction: str
    min_effect_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.metric not in CLAIM_METRICS:
            raise ValueError(f"metric: must be one of {', '.join(CLAIM_METRICS)}, got "
                             f"{describe(self.metric)}")
        for key in ("policy", "baseline"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key}: must be an arm label, got {describe(value)}")
        if self.policy == self.baseline:
            raise ValueError(f"baseline: must differ from policy, both are {self.policy!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction: must be one of {', '.join(DIRECTIONS)}, got "
                             f"{describe(self.direction)}")
        if not is_number(self.min_effect_pct) or not 0 <= self.min_effect_pct < 100:
            raise ValueError(f"min_effect_pct: must be a number in 0..100 (percent), got "
                             f"{describe(self.min_effect_pct)}")
        object.__setattr__(self, "min_effect_pct", float(self.min_effect_pct))

    def text(self) -> str:
        """The claim in words, e.g. "hetroute lower than greedy on mean_latency"."""
        more = f" by more than {self.min_effect_pct:g}%" if self.min_effect_pct else ""
        return f"{self.policy} {self.direction} than {self.baseline} on {self.metric}{more}"

    def to_data(self) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": self.metric, "policy": self.policy,
                               "baseline": self.baseline, "direction": self.direction}
        if self.min_effect_pct:
            out["min_effect_pct"] = self.min_effect_pct
        return out


def judge(claim: Claim, ci_low_pct: float, ci_high_pct: float) -> str:
    """held / not held / reversed / n/a of `claim` on a CI of the change in % (module
    docstring)."""
    if not (math.isfinite(ci_low_pct) and math.isfinite(ci_high_pct)):
        return NA
    m = claim.min_effect_pct
    if claim.direction == "lower":
        if ci_high_pct < -m:
            return HELD
        return REVERSED if ci_low_pct > 0 else NOT_HELD
    if ci_low_pct > m:
        return HELD
    return REVERSED if ci_high_pct < 0 else NOT_HELD


def read_claims(raw: Any, loc: Loc) -> tuple[Claim, ...]:
    """The YAML `claims:` list; an error names the entry, the field and the value."""
    if not isinstance(raw, list):
        raise loc.error(f"must be a list of claims ({{metric, policy, baseline, direction}}), "
                        f"got {describe(raw)}")
    out: list[Claim] = []
    for i, item in enumerate(raw):
        at = loc.item(raw, i)
        if not isinstance(item, dict):
            raise at.error(f"must be a mapping {{metric, policy, baseline, direction}}, got "
                           f"{describe(item)}")
        unknown = sorted(str(k) for k in set(item) - set(_KEYS))
        if unknown:
            raise at.error(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(_KEYS)})")
        missing = [k for k in _KEYS[:4] if k not in item]
        if missing:
            raise at.error(f"missing field(s) {', '.join(missing)}")
        try:
            claim = Claim(**item)
        except ValueError as exc:
            raise at.error(str(exc)) from None
        if claim in out:
            raise at.error(f"the same claim is listed twice ({claim.text()})")
        out.append(claim)
    return tuple(out)


def check_labels(claims: Sequence[Claim], labels: Sequence[str]) -> None:
    """ValueError "claims[i].policy: ..." when a claim names an arm the scenario lacks."""
    for i, c in enumerate(claims):
        for key in ("policy", "baseline"):
            if getattr(c, key) not in labels:
                raise ValueError(f"claims[{i}].{key}: no arm {getattr(c, key)!r} in the "
                                 f"scenario (arms: {', '.join(labels)})")
