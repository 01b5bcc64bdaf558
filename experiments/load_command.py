"""`moemesh load SCENARIO`: the scenario's workload against the mesh that `moemesh up` keeps.

    moemesh up experiments/scenarios/quickstart.yaml --tdf 2
    moemesh load experiments/scenarios/quickstart.yaml --policy hetroute --duration 20s &
    moemesh fault link-down edge1 edge2 --for 5s       # while the load runs
    moemesh down

`moemesh run` starts a mesh of its own, runs every arm on it and stops it; `load` leaves the
mesh as it is: one arm, the mesh's placement and router settings, on the mesh's wall clock and
time dilation (state.json), with the faults a user injects by hand (the scenario's own `faults`
are not applied: that is `run`'s timeline). The users are the scenario's (arrivals, homes,
prompts, seeds), so a load and a run of one scenario send the same requests. Writes
tokens.csv, requests.csv and summary.json (the run's columns and figures) into --out; live
progress as `run` shows it. Exit 0 when the load is written (failed tokens are results: a
fault was injected), 2 on bad input (no mesh up, an arm the mesh cannot run as it stands).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.runclock import RunClock
from services.commandline import add_command

from .commands import add_shorten_flags, chosen_arms

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "load", _load)
    p.add_argument("scenario", type=Path, help="scenario YAML whose workload to send (its "
                   "nodes must be the mesh's), e.g. experiments/scenarios/quickstart.yaml")
    p.add_argument("--mesh-dir", type=Path, default=None,
                   help="the mesh's state folder, as given to `moemesh up` (default: "
                        "$MOEMESH_MESH_DIR, $XDG_RUNTIME_DIR/moemesh or /tmp/moemesh-<uid>)")
    p.add_argument("--policy", metavar="LABEL",
                   help="the arm to send: an arm of the scenario or a registered router "
                        "policy, e.g. greedy (default: the scenario's first arm)")
    add_shorten_flags(p)
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="results folder (default: results/NAME-load)")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier run in --out (a folder moemesh did not make is "
                        "always refused)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def _arm_for_mesh(scenario: Any, arms: tuple, label: str | None, state: dict[str, Any]) -> Any:
    """The arm to send; ValueError when the mesh as it stands cannot run it as `run` would."""
    arm = chosen_arms([label], arms)[0] if label else arms[0]
    if arm.settings:
        raise ValueError(f"--policy {arm.label}: the arm sets router settings "
                         f"({', '.join(k for k, _ in arm.settings)}), and a mesh that stays up "
                         f"keeps its own: use `moemesh run --policies {arm.label}`")
    if arm.dense != "home":
        raise ValueError(f"--policy {arm.label}: the arm runs the dense part on "
                         f"{arm.dense}, which needs its own mesh configuration: use "
                         f"`moemesh run --policies {arm.label}`")
    wanted, held = arm.placement_of(scenario), state.get("policy")
    if wanted != held:
        raise ValueError(f"--policy {arm.label}: the arm's placement is {wanted}, the mesh "
                         f"holds {held}: start the mesh with `moemesh up ... --policy "
                         f"{wanted}`, or pick another arm")
    return arm


def _load(args: argparse.Namespace) -> int:
    """send a scenario's workload to the mesh `moemesh up` keeps (one policy, live progress,
    results folder)

    Drive the running mesh's home nodes with the scenario's seeded users for one policy, as
    `moemesh run` does for each arm, without starting, resetting or stopping anything; inject
    faults meanwhile with `moemesh fault`. Writes tokens.csv, requests.csv and summary.json into
    --out.
    """
    from orchestrator.mesh.commands import ready_state
    from orchestrator.scenario.arms import load_experiment

    from .analysis.metrics import policy_stats
    from .run.driver import Driver
    from .run.outdir import claim_out, finish_out
    from .run.progress import RunProgress
    from .run.rows import RequestRow, TokenRow, write_rows
    from .run.runner import shorten
    from .run.workload import plan_workload

    scenario, arms = load_experiment(args.scenario)
    faults = len(scenario.faults)  # `run`'s timeline, not this command's
    scenario, notes = shorten(replace(scenario, faults=()), requests=args.requests,
                              duration_s=args.duration)
    _, state = ready_state(args.mesh_dir)
    urls = {name: ep["url"] for name, ep in (state.get("endpoints") or {}).items()}
    unknown = sorted(set(scenario.topology.names) - set(urls))
    if unknown:
        raise ValueError(f"{args.scenario}: node(s) {', '.join(unknown)} are not in the mesh "
                         f"{state.get('name')} (its nodes: {', '.join(sorted(urls))})")
    arm = _arm_for_mesh(scenario, arms, args.policy, state)
    rc = RunClock(float(state.get("time_dilation") or 1.0))  # the mesh's, as `up` recorded it
    if faults:
        notes.append(f"the scenario's {faults} fault(s) are not applied: inject faults with "
                     "`moemesh fault`")
    plan = plan_workload(scenario)
    out = args.out or Path("results") / f"{scenario.name}-load"
    claim_out(out, force=args.force, scenario=scenario.name)
    ok = False
    try:
        with RunProgress(f"moemesh load: {scenario.name} on mesh {state.get('name')} (clock "
                         f"realtime, time dilation {rc.dilation:g})", quiet=args.quiet) as progress:
            for note in notes:
                progress.note(note)
            progress.arm(arm.label, len(plan.requests) if not plan.closed else None)
            driver = Driver(plan, arm, urls, run_clock=rc, on_request=progress.on_request,
                            budget=arm.budget_of(scenario))
            result = asyncio.run(driver.run())
            progress.end_arm()
        write_rows(out / "tokens.csv", result.tokens, TokenRow)
        write_rows(out / "requests.csv", result.requests, RequestRow)
        stats = policy_stats(arm.label, result.tokens, result.requests,
                             warmup_s=scenario.workload.warmup_s, slo_ms=scenario.slo_ms)
        summary = {"scenario": scenario.name, "mesh": state.get("name"),
                   "runtime": state.get("runtime"), "shaper": state.get("shaper"),
                   "placement": state.get("policy"), "clock": "realtime",
                   "time_dilation": rc.dilation, "wall_s": round(result.wall_s, 3),
                   "notes": notes, "policies": {arm.label: stats.summary()}}
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        ok = True
    finally:
        finish_out(out, ok)
    lat = stats.latency
    print(f"{arm.label}: {stats.requests} requests, {stats.tokens} tokens done, "
          f"{stats.failed_tokens} failed"
          + (f" ({', '.join(f'{k} {v}' for k, v in sorted(stats.reasons.items()))})"
             if stats.reasons else "")
          + f"; token latency mean {lat.get('mean', float('nan')):.1f} ms, p99 "
          f"{lat.get('p99', float('nan')):.1f} ms (scenario time); results in {out}")
    return 0
