"""run.json as one typed record, written and read as the same type.

run.json's vocabulary lives here and nowhere else (docs/contracts.md, "run.json"): the runner
(experiments.run.runner) fills a `RunMeta` as the run goes and writes it with `to_json`; every
reader (report, resume, crosscheck, study, capacity, metrics) gets it from `from_json` (or
`read`). Nested parts that other modules own stay plain JSON mappings inside the record
(placements, fidelity, calibration, each arm's fault records...).

`from_json` is tolerant of older run folders: a missing field takes the default such a run
implies (so `moemesh report DIR` still redraws runs recorded before a field existed), and a
field of the wrong type is a ValueError naming it. Keys it does not know are kept in `extra`,
so `to_json` gives back what was read. `to_json` writes the fields in declaration order (the
order run.json has always had), leaves out an OPTIONAL field that is None or empty (a key a
run only has when something happened: an error, a resume, a node death...), and turns what
JSON has no word for into what it has (`jsonable`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from moe.vocab import is_number
from orchestrator.scenario.scenario import DEFAULT_SLO_MS

__all__ = ["RunMeta", "jsonable"]

_MISSING = object()
_REQUIRED = ("scenario", "arms")
# run.json leaves such a field out when it is None or empty
OPTIONAL: dict[str, Any] = {"optional": True}


@dataclass(kw_only=True)
class RunMeta:
    """How a run was made and what it recorded besides its rows (declaration order is
    run.json's key order). Mutable: the runner fills it while the run goes."""

    format: int = 1
    scenario: str
    description: str = ""
    model: str = "?"
    model_mode: str = "real"  # real | modeled
    seed: int = 0
    time_dilation: float = 1.0  # the run's (after calibration, when `auto`)
    slo_ms: float = DEFAULT_SLO_MS
    warmup_s: float = 0.0
    quality_budget_pct: float = 2.0
    arms: tuple[dict[str, Any], ...]  # label, policy, placement, redundancy, budget, settings
    workload: str = ""  # the plan in words
    heldout_sha256: str = ""  # the held-out text the prompts come from
    notes: tuple[str, ...] = ()
    started: str = ""
    host: dict[str, Any] = field(default_factory=dict)  # versions, cpus, commit
    # the versions of the packages that can change results, and the lock's hash
    # (orchestrator.lockfile)
    versions: dict[str, Any] = field(default_factory=dict, metadata=OPTIONAL)
    lock_sha256: str | None = field(default=None, metadata=OPTIONAL)
    scenario_data: dict[str, Any] = field(default_factory=dict)  # the scenario as run
    scenario_sha256: str | None = None  # the scenario file's (orchestrator.scenario.claims)
    claims: tuple[dict[str, Any], ...] = ()  # pre-registered claims (experiments.analysis.prereg)
    runtime: str = "?"
    shaper: str = "?"
    clock: str = "realtime"  # realtime | virtual (experiments.run.clock)
    virtual_speedup: float | None = None
    placements: dict[str, Any] = field(default_factory=dict)  # name → placement record
    faults: dict[str, Any] = field(default_factory=dict)  # label → event records
    quality: dict[str, Any] = field(default_factory=dict)  # label → scores
    timings: dict[str, Any] = field(default_factory=dict)  # step → wall seconds
    overhead: dict[str, Any] | None = None  # the zero-delay run: arm, requests, links
    load: dict[str, Any] = field(default_factory=dict)  # label → [before, after]
    trace: dict[str, Any] | None = None  # the --trace file
    options: dict[str, Any] = field(default_factory=dict)  # run options that shape the rows
    run_id: str = ""  # experiments.run.outdir
    repeats: dict[str, Any] = field(default_factory=dict)  # n, orders
    # scenario file and flags, for --resume
    command: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # time_dilation: auto (.calibrate)
    calibration: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # each --resume: at, kept, commit
    resumed: tuple[dict[str, Any], ...] = field(default=(), metadata=OPTIONAL)
    # the virtual clock's counters
    clock_stats: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # planned, done, state, partial (.parts)
    parts: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    error: str | None = field(default=None, metadata=OPTIONAL)  # why the run stopped
    # label → where its dense part runs
    dense: dict[str, Any] = field(default_factory=dict, metadata=OPTIONAL)
    # router.batching, and its arms
    batching: dict[str, Any] = field(default_factory=dict, metadata=OPTIONAL)
    # experiments.analysis.fidelity
    fidelity: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # orchestrator.mesh.supervisor
    runtime_notes: tuple[str, ...] = field(default=(), metadata=OPTIONAL)
    # label → node → lag (.looplag)
    loop_lag: dict[str, Any] = field(default_factory=dict, metadata=OPTIONAL)
    # label → deaths (.supervisor)
    node_deaths: dict[str, Any] = field(default_factory=dict, metadata=OPTIONAL)
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
            if raw is _MISSING or (raw is None and f.name not in _REQUIRED):
                continue  # an older run: the default
            values[f.name] = _typed(source, f.name, str(f.type), raw)
        for name in _REQUIRED:
            if name not in values:
                raise ValueError(f"{source}: field {name!r} is missing")
        bad = [i for i, a in enumerate(values["arms"]) if not isinstance(a, dict)
               or "label" not in a]
        if bad:
            raise ValueError(f"{source}: field 'arms' entry {bad[0]} has no label")
        known = {f.name for f in fields(cls)}
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, path: Path) -> RunMeta:
        """The record in the file `path` (ValueError naming it when it is not JSON)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        return cls.from_json(data, str(path))

    def to_json(self) -> dict[str, Any]:
        """run.json's content: the fields in order (an optional one left out when None or
        empty), then the keys this record does not know; plain JSON values throughout."""
        out: dict[str, Any] = dict(self.extra)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (f.metadata.get("optional") and value in (None, {}, ())):
                continue
            out.pop(f.name, None)
            out[f.name] = value
        return jsonable(out)


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: tuples as lists, numpy scalars and arrays as numbers and lists,
    a non-finite float as null, anything else unknown as its str."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def _typed(source: str, name: str, kind: str, raw: Any) -> Any:
    where = f"{source}: field {name!r}"
    kind = kind.removesuffix(" | None")
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
