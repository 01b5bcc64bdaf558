"""run.json as a typed record: what the report reads of how a run was made.

`RunMeta.from_json` reads run.json's content (docs/contracts.md, "run.json"): every field the
report uses, with the default an older run folder implies when the field is missing (so
`moemesh report DIR` still redraws runs recorded before a field existed), and a ValueError
naming the field when one has the wrong type. Keys it does not know are kept in `extra`, so
`to_json` gives back what was read (with any field changed by `dataclasses.replace`): the
modules that take the plain mapping (metrics, faithful, reproduce) get exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from moe.vocab import is_number
from orchestrator.scenario import DEFAULT_SLO_MS

__all__ = ["RunMeta"]

_MISSING = object()


@dataclass(frozen=True)
class RunMeta:
    scenario: str
    arms: tuple[dict[str, Any], ...]  # label, policy, placement, redundancy, budget, settings
    description: str = ""
    model: str = "?"
    model_mode: str = "real"  # real | modeled
    seed: int = 0
    time_dilation: float = 1.0
    slo_ms: float = DEFAULT_SLO_MS
    warmup_s: float = 0.0
    quality_budget_pct: float = 2.0
    workload: str = ""
    runtime: str = "?"
    shaper: str = "?"
    started: str = ""
    notes: tuple[str, ...] = ()
    host: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)  # label → [before, after]
    faults: dict[str, Any] = field(default_factory=dict)  # label → event records
    quality: dict[str, Any] = field(default_factory=dict)  # label → scores
    placements: dict[str, Any] = field(default_factory=dict)
    repeats: dict[str, Any] = field(default_factory=dict)  # n, orders
    loop_lag: dict[str, Any] = field(default_factory=dict)
    dense: dict[str, Any] = field(default_factory=dict)  # label → where its dense part runs
    overhead: dict[str, Any] | None = None  # the zero-delay run: arm, requests, links
    trace: dict[str, Any] | None = None  # the --trace file
    fidelity: dict[str, Any] | None = None  # experiments.fidelity
    extra: dict[str, Any] = field(default_factory=dict)  # every other key of run.json

    @property
    def labels(self) -> list[str]:
        return [str(a["label"]) for a in self.arms]

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "run.json") -> RunMeta:
        """The record of run.json's content; ValueError naming `source` and the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: not a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra":
                continue
            raw = data.get(f.name, _MISSING)
            if raw is _MISSING or (raw is None and f.name not in ("scenario", "arms")):
                continue  # an older run: the default
            values[f.name] = _typed(source, f.name, str(f.type), raw)
        for name in ("scenario", "arms"):
            if name not in values:
                raise ValueError(f"{source}: field {name!r} is missing")
        bad = [i for i, a in enumerate(values["arms"]) if not isinstance(a, dict)
               or "label" not in a]
        if bad:
            raise ValueError(f"{source}: field 'arms' entry {bad[0]} has no label")
        known = {f.name for f in fields(cls)}
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        """run.json's content again: the fields, then the keys this record does not know."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out["arms"], out["notes"] = list(self.arms), list(self.notes)
        return {**self.extra, **out}


def _typed(source: str, name: str, kind: str, raw: Any) -> Any:
    where = f"{source}: field {name!r}"
    if kind == "str":
        return str(raw)
    if kind == "int":
        if not is_number(raw, integer=True):
            raise ValueError(f"{where} must be an integer, got {raw!r}")
        return raw
    if kind == "float":
        if not is_number(raw, finite=False):
            raise ValueError(f"{where} must be a number, got {raw!r}")
        return float(raw) if math.isfinite(raw) else math.nan
    if kind.startswith("tuple"):
        if not isinstance(raw, list | tuple):
            raise ValueError(f"{where} must be a list, got {type(raw).__name__}")
        return tuple(str(x) for x in raw) if kind == "tuple[str, ...]" else tuple(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    return dict(raw)
