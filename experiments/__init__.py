"""Experiments: what users run moemesh for (`moemesh run`, `moemesh report`, `moemesh sweep`).

Compute → rows → render:

* `plan_workload(scenario)` — the seeded requests every policy sees (`experiments.run.workload`);
* `load_experiment(path)` — a scenario and its arms (router policy, optionally with its own
  placement, redundancy, budget or router settings; `orchestrator.scenario.arms`);
* `run_experiment(scenario, arms, open_live, out)` — each arm on a live mesh, faults on their
  timeline, quality scored, the overhead run; raw rows and run.json written
  (`experiments.run.runner`, `experiments.run.live`); returns run.json's record;
* `RunMeta` — run.json as one typed record, the runner's and every reader's
  (`experiments.run.runmeta`);
* `build_report(out)` — summary.json (docs/contracts.md), report.md and plots from the raw rows
  (`experiments.report.report`, `experiments.analysis.metrics`, `experiments.report.plots`,
  `experiments.reproduce.papers`).

Names load on first use: every `moemesh` command (a node process too) imports this package
to build its parser, and must not pay for matplotlib or scipy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Arm", "RunMeta", "RunOptions", "build_report", "load_experiment", "plan_workload",
           "run_experiment"]

_WHERE = {"Arm": "orchestrator.scenario.arms", "load_experiment": "orchestrator.scenario.arms",
          "plan_workload": "experiments.run.workload", "RunMeta": "experiments.run.runmeta",
          "RunOptions": "experiments.run.runner", "run_experiment": "experiments.run.runner",
          "build_report": "experiments.report.report"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'experiments' has no attribute {name!r}")
