"""Experiments: what users run moemesh for (`moemesh run`, `moemesh report`, `moemesh sweep`).

Compute → rows → render:

* `plan_workload(scenario)` — the seeded requests every policy sees (`experiments.workload`);
* `load_experiment(path)` — a scenario and its arms (router policy, optionally with its own
  placement, redundancy, budget or router settings; `experiments.arms`);
* `run_experiment(scenario, arms, open_live, out)` — each arm on a live mesh, faults on their
  timeline, quality scored, the overhead run; raw rows and run.json written
  (`experiments.runner`, `experiments.live`); returns run.json's record;
* `RunMeta` — run.json as one typed record, the runner's and every reader's
  (`experiments.runmeta`);
* `build_report(out)` — summary.json (docs/contracts.md), report.md and plots from the raw rows
  (`experiments.report`, `experiments.metrics`, `experiments.plots`,
  `experiments.reproduce`).

Names load on first use: every `moemesh` command (a node process too) imports this package
to build its parser, and must not pay for matplotlib or scipy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Arm", "RunMeta", "RunOptions", "build_report", "load_experiment", "plan_workload",
           "run_experiment"]

_WHERE = {"Arm": "arms", "load_experiment": "arms", "plan_workload": "workload",
          "RunMeta": "runmeta", "RunOptions": "runner", "run_experiment": "runner",
          "build_report": "report"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'experiments' has no attribute {name!r}")
