"""`moemesh run --resume DIR`: finish a stopped run, and refuse when it would not be the same run.

A run folder keeps each finished part (an arm in a repetition, the overhead run) on disk as
it finishes (experiments.run.parts). Resuming runs only the parts that are not there, on the same
workload plan and seeds, and then draws the report from all of them. The parts already there
were measured by one version of the code on one scenario; resuming with another would mix two
experiments in one report, so `check` refuses (ValueError: exit 2) when any of these differ
from what DIR/run.json recorded, naming which:

- the code's commit (`host.commit`, `git rev-parse --short HEAD`);
- the scenario as run (`scenario_data`: topology, workload, faults, model, dilation, ...,
  after --requests/--duration/--tdf/--runtime/--shaper);
- the arms (labels, policies, placements, budgets, settings) and the run options that shape
  the rows (`options`: repeat, quality windows, overhead requests, SLO) and the `--trace`.

The host may differ (another machine, a reboot): run.json's `resumed` records each resume.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .runmeta import RunMeta

__all__ = ["check", "load"]


def load(out: Path) -> RunMeta:
    """DIR/run.json of the run to resume (ValueError naming the file when there is none, or
    when it is not a resumable run's)."""
    path = Path(out) / "run.json"
    if not path.is_file():
        raise ValueError(f"--resume {out}: no run.json there, nothing to resume")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--resume {out}: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or "scenario_data" not in data or "parts" not in data:
        raise ValueError(f"--resume {out}: {path} has no 'scenario_data' and 'parts' (a run "
                         f"made before runs could be resumed, or not a run folder)")
    try:
        return RunMeta.from_json(data, str(path))
    except ValueError as exc:
        raise ValueError(f"--resume {out}: {exc}") from None


def _diff(old: Any, new: Any, where: str = "") -> list[str]:
    """Paths (a.b[2].c) where two JSON values differ, at most a few."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
        return out
    if (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in _diff(a, b, f"{where}[{i}]")]
    return [] if old == new else [where or "(the whole value)"]


def _names(paths: Sequence[str]) -> str:
    return ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")


def check(old: RunMeta, new: RunMeta, out: Path) -> None:
    """Refuse (ValueError naming what differs) unless `new` (the record the resumed run
    starts from) is the same run as `old` (DIR/run.json's)."""
    was, now = old.host.get("commit"), new.host.get("commit")
    if was != now:
        raise ValueError(f"--resume {out}: the code's commit differs: the run was made at "
                         f"{was or 'an unknown commit'}, this is {now or 'an unknown commit'} "
                         f"(check that commit out, or start a new run)")
    old_json, new_json = old.to_json(), new.to_json()  # compared as run.json has them
    paths = _diff(old_json.get("scenario_data"), new_json.get("scenario_data"))
    if paths:
        raise ValueError(f"--resume {out}: the scenario differs from the one the run was made "
                         f"with, at {_names(paths)} (give the same scenario file and flags, "
                         f"or none: --resume alone reruns what run.json recorded)")
    for key, what in (("arms", "the policies"), ("options", "the run options"),
                      ("trace", "the --trace file")):
        paths = _diff(old_json.get(key), new_json.get(key), key)
        if paths:
            raise ValueError(f"--resume {out}: {what} differ from the run's, at "
                             f"{_names(paths)}")
