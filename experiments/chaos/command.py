"""`moemesh chaos SCENARIO [--duration 120s] [--seed S]`: the scenario's mesh under a random,
seeded fault timeline that never cuts an expert off, with its invariants checked
(experiments.chaos.run). Exit 0 when every invariant held, 1 when one broke, 2 on bad input, 130
on Ctrl-C (the mesh is stopped and checked for leaks first).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.commandline import add_command

from ..commands import _duration

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "chaos", _chaos)
    p.add_argument("scenario", type=Path,
                   help="scenario YAML, e.g. experiments/scenarios/quickstart.yaml")
    p.add_argument("--duration", type=_duration, default=120.0, metavar="TIME",
                   help="how long the workload and the faults run (scenario time), e.g. 120s")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault timeline, e.g. 1")
    p.add_argument("--homes", metavar="LIST",
                   help="nodes that send requests and are never killed, e.g. edge1,edge2 "
                        "(default: those with the most users, at most half the nodes)")
    p.add_argument("--policies", metavar="LIST",
                   help="router policies to run side by side, e.g. hetroute,greedy (default: "
                        "the scenario's, those on its own placement)")
    p.add_argument("--rate", type=float, metavar="RPS",
                   help="requests per second of all policies together, e.g. 2 (default: the "
                        "scenario's)")
    p.add_argument("--clock", choices=["virtual", "realtime", "auto"],
                   help="virtual (the scenario's clock by default where it says so) or "
                        "realtime (dilated by --tdf); see `moemesh run --help`")
    p.add_argument("--tdf", type=float, metavar="FACTOR",
                   help="time dilation, e.g. 4 (default: the scenario's factor, 1 if auto)")
    p.add_argument("--runtime", choices=["local", "netns", "docker"],
                   help="override the scenario's runtime, e.g. local")


def _names(text: str | None, flag: str, known: list[str]) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"{flag}: {', '.join(bad) or 'empty'} not among {', '.join(known)}")
    return names


def _chaos(args: argparse.Namespace) -> int:
    """run a scenario's mesh under random faults and check that no token that could be served is
    lost

    Start the scenario's mesh, run its policies' workload from the home nodes while a seeded
    random timeline cuts and degrades links, kills, revives and slows nodes (never every
    full-precision replica of an expert at once), check every token, and look for leftovers.
    Exit 1 when an invariant broke.
    """
    from dataclasses import replace

    from orchestrator.mesh.chaos import ChaosSpec
    from orchestrator.scenario.arms import load_experiment

    from ..run.clock import clock_for_overrides, resolve_clock, run_clocked
    from .run import default_homes, run_chaos

    scenario, arms = load_experiment(args.scenario)
    scenario = replace(scenario, **clock_for_overrides(
        scenario, args.clock, dilated=args.tdf is not None, changed=bool(args.runtime)))
    if args.runtime:
        scenario = replace(scenario, runtime=args.runtime,
                           shaper="auto" if scenario.shaper == "tc" and args.runtime == "local"
                           else scenario.shaper)
    if args.tdf is not None:
        if not args.tdf >= 1:
            raise ValueError(f"--tdf must be >= 1, got {args.tdf:g}")
        scenario = replace(scenario, time_dilation=args.tdf, auto_dilation=False)
    scenario, notes = resolve_clock(scenario, args.clock)
    for note in notes:
        print(f"moemesh chaos: {note}")
    if args.rate is not None and not args.rate > 0:
        raise ValueError(f"--rate must be > 0, got {args.rate:g}")
    own = [a for a in arms if a.placement is None and a.redundancy is None]
    wanted = _names(args.policies, "--policies", [a.label for a in own])
    if wanted is not None:
        own = [a for a in own if a.label in wanted]
    if not own:
        raise ValueError("no policy of the scenario runs on its own placement")
    homes = (_names(args.homes, "--homes", list(scenario.topology.names))
             or list(default_homes(scenario)))
    spec = ChaosSpec(args.duration, args.seed, tuple(homes))
    result = run_clocked(run_chaos(scenario, own, spec, rate_rps=args.rate), scenario)
    return 1 if result.violations else 0
