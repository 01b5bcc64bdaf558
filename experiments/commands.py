"""`moemesh run`, `moemesh report` and `moemesh sweep`: what users run moemesh for.

    moemesh run experiments/scenarios/quickstart.yaml --out results/quickstart
    moemesh run SCENARIO --requests 6 --out /tmp/ci      # a shortened run (CI)
    moemesh run SCENARIO --repeat 4                      # every policy 4 times, interleaved
    moemesh report results/quickstart                    # redraw from the raw records
    moemesh sweep SCENARIO --knob redundancy --values 1,2,3 --out results/sweep-redundancy
    moemesh study SCENARIO --topologies 8 --seeds 2      # across worlds (experiments.study.run)

Bad input (a scenario file, a flag) raises ValueError: `moemesh` prints it and exits 2.
A run that is not faithful (experiments.analysis.faithful) ends with a warning on stderr naming why;
the exit status stays 0 (the run itself worked, and its report says the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe.vocab import is_number
from services.commandline import add_command

from .run.clock import clock_for_overrides, resolve_clock, run_clocked

if TYPE_CHECKING:
    from .run.runmeta import RunMeta

__all__ = ["add_shorten_flags", "chosen_arms", "register"]


def _duration(text: str) -> float:
    from orchestrator.scenario.units import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_shorten_flags(p: argparse.ArgumentParser) -> None:
    """--requests N | --duration T: a shorter workload (`runner.shorten`)."""
    short = p.add_mutually_exclusive_group()
    short.add_argument("--requests", type=int, metavar="N",
                       help="shorten the workload to N requests, e.g. 6 (CI)")
    short.add_argument("--duration", type=_duration, metavar="TIME",
                       help="shorten the workload to this scenario time, e.g. 10s")


def add_ladder_flags(p: argparse.ArgumentParser) -> None:
    """--loads and --slo-target, the capacity ladder's flags (`run` and `study`)."""
    p.add_argument("--loads", metavar="LIST",
                   help="with --capacity: the offered loads, req/s (open loop) or users "
                        "(closed loop), e.g. 10,20,40,80 (default: the scenario's "
                        "capacity.loads, else its load x 5, 20, 40)")
    p.add_argument("--slo-target", type=float, default=0.9, metavar="SHARE",
                   help="with --capacity: the share of requests within the SLO a load must "
                        "reach, e.g. 0.9")


def _add_run_flags(p: argparse.ArgumentParser, both: bool = False,
                   resumable: bool = False) -> None:
    p.add_argument("scenario", type=Path, nargs="?" if resumable else None,
                   help="scenario YAML, e.g. experiments/scenarios/quickstart.yaml"
                        + (" (optional with --resume)" if resumable else ""))
    p.add_argument("--runtime", choices=["local", "netns", "docker"],
                   help="override the scenario's runtime, e.g. local (netns needs root)")
    p.add_argument("--shaper", choices=["tc", "app", "auto"],
                   help="override the scenario's link shaper, e.g. app (tc needs sch_netem)")
    p.add_argument("--workers", type=int, metavar="K",
                   help="run the mesh in K partition processes, each a group of nodes on one "
                        "loop with its own virtual clock, e.g. 1: the whole mesh in this "
                        "process (local runtime, virtual clock; default: the scenario's "
                        "workers, else one process a node)")
    add_shorten_flags(p)
    p.add_argument("--policies", metavar="LIST",
                   help="run only these arms of the scenario, comma-separated, e.g. "
                        "hetroute,greedy; a registered policy the scenario does not list "
                        "(a plug-in's too, docs/extending.md) runs as a default arm")
    p.add_argument("--quality-windows", type=int, default=8, metavar="N",
                   help="held-out windows scored per policy for quality, e.g. 8 (0: none)")
    p.add_argument("--overhead-requests", type=int, default=0, metavar="N",
                   help="requests of an extra run on zero-delay links, e.g. 30 (default 0: "
                        "none; every token's latency split already measures the host's share)")
    p.add_argument("--slo-ms", type=float, metavar="MS",
                   help="SLO on a request's mean token latency, scenario ms, e.g. 300 "
                        "(default: the scenario's slo_ms, 300)")
    p.add_argument("--repeat", type=int, metavar="N",
                   help="run the whole set of policies N times, each time in a "
                        "counterbalanced order (rotated, then reversed), e.g. 4; the report "
                        "shows the run-to-run spread (default: the scenario's repeat, 1)")
    p.add_argument("--clock", choices=["virtual", "realtime", "auto", *(["both"] if both else [])],
                   help="virtual: every process on one clock that jumps to the next event "
                        "(exact, repeatable, as fast as the host computes; app shaper, local, "
                        "netns or docker runtime on one host); realtime: the wall clock, "
                        "dilated by --tdf; auto: virtual where it can run"
                        + ("; both: virtual, then realtime, and "
                           "their paired difference (crosscheck.md)" if both else "")
                        + " (default: the scenario's clock)")
    p.add_argument("--tdf", type=_tdf, metavar="FACTOR",
                   help="time dilation, a factor >= 1 or auto (the smallest factor at which "
                        "the host's overhead share is small, measured on the live mesh), "
                        "e.g. 8 or auto (default: the scenario's time_dilation)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier run in --out (default: refuse; a folder "
                        "moemesh did not make is always refused)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="modeled mode: route by this trace instead of the seeded synthetic "
                        "one, e.g. routed_experts.npy (vLLM's [tokens, layers, top_k]) or "
                        "routing.jsonl (`moemesh trace export`)")


def _tdf(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a factor >= 1 or auto, got {text!r}") from None
    if not (value >= 1 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"a factor >= 1 or auto, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    run = add_command(sub, "run", _run)
    _add_run_flags(run, both=True, resumable=True)
    run.add_argument("--resume", type=Path, metavar="DIR",
                     help="finish a stopped run in DIR, e.g. results/quickstart: only the "
                          "policies and repetitions not on disk run, on the same seeds; the "
                          "scenario and flags come from DIR/run.json (given ones must match); "
                          "refused when the scenario or the code's commit differ")
    run.add_argument("--out", type=Path, metavar="DIR",
                     help="results folder, e.g. results/quickstart (default: results/NAME, "
                          "results/NAME-capacity with --capacity)")
    run.add_argument("--no-link-probe", action="store_true",
                     help="skip the link fidelity probe before the first arm (every pair's "
                          "link, O(nodes^2): on a 100-node mesh most of the run's clock "
                          "advances); the report then has no link table")
    run.add_argument("--capacity", action="store_true",
                     help="find each policy's highest offered load within the SLO: the arms "
                          "(not exact, not budget/redundancy variants unless named in "
                          "--policies) at each load of a ladder, --requests N requests per load "
                          "(default 16); writes capacity.json, capacity.md and capacity.png")
    add_ladder_flags(run)

    rep = sub.add_parser("report", help="redraw a run's summary, report and plots from its "
                         "raw records (no rerun)")
    rep.add_argument("folder", type=Path, help="a `moemesh run --out` folder, e.g. "
                     "results/quickstart")
    rep.add_argument("--slo-ms", type=float, metavar="MS",
                     help="another SLO for the report, e.g. 200 (default: the run's)")
    rep.add_argument("--format", choices=("svg", "png", "both"), default="both",
                     help="figure files: svg (for a paper), png (200 dpi) or both (default)")
    rep.set_defaults(handler=_report)

    tr = sub.add_parser("trace", help="routing traces: export a run's routing decisions")
    tsub = tr.add_subparsers(dest="trace_command", required=True)
    ex = tsub.add_parser("export", help="write a run's routing (request, token, layer, "
                         "experts, gate weights) as a trace file")
    ex.add_argument("folder", type=Path, help="a `moemesh run --out` folder, e.g. "
                    "results/quickstart")
    ex.add_argument("--out", type=Path, metavar="FILE",
                    help="the trace file: .jsonl (with gate weights) or .npy (vLLM's "
                         "routed-experts array), e.g. trace.npy (default: FOLDER/trace.jsonl)")
    ex.add_argument("--policy", metavar="LABEL",
                    help="the arm whose routing to export, e.g. hetroute (default: the first)")
    ex.add_argument("--rep", type=int, default=0, metavar="N",
                    help="the repetition, e.g. 0 (default)")
    ex.set_defaults(handler=_trace_export)

    from .sweep import DEFAULT_VALUES, KNOBS

    sw = sub.add_parser("sweep", help="run a scenario again for each value of one knob",
                        description="Knobs: " + ", ".join(
                            f"{k} ({v}; default values {', '.join(map(str, DEFAULT_VALUES[k]))})"
                            for k, v in KNOBS.items()))
    _add_run_flags(sw)
    sw.add_argument("--knob", required=True, choices=list(KNOBS),
                    help="what to sweep, e.g. redundancy")
    sw.add_argument("--values", metavar="LIST",
                    help="comma-separated values, e.g. 1,1.5,2,3 (default: the knob's)")
    sw.add_argument("--out", type=Path, metavar="DIR",
                    help="sweep folder, e.g. results/sweep-redundancy "
                         "(default: results/NAME-sweep-KNOB)")
    sw.add_argument("--resume", action="store_true",
                    help="continue a stopped sweep in --out with the same SCENARIO and flags: "
                         "finished points are kept, a stopped point runs only what it lacks "
                         "(as `moemesh run --resume`), the others run")
    sw.set_defaults(handler=_sweep)

    from .load_command import register as register_load  # `moemesh load`
    from .study.command import register as register_study  # `moemesh study`

    register_study(sub)
    register_load(sub)


# ----------------------------------------------------------------------------- handlers


def _prepare(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    from dataclasses import replace

    from orchestrator.scenario.arms import load_experiment

    from .run.runner import shorten

    scenario, arms = load_experiment(args.scenario)
    changes: dict[str, Any] = {}
    if args.runtime:
        changes["runtime"] = args.runtime
    if args.shaper:
        changes["shaper"] = args.shaper
    if getattr(args, "workers", None) is not None:
        changes["workers"] = args.workers
    if args.tdf == "auto":
        changes["auto_dilation"] = True
    elif args.tdf is not None:
        changes.update(time_dilation=args.tdf, auto_dilation=False)
    if changes.get("runtime") == "local" and "shaper" not in changes and scenario.shaper == "tc":
        changes["shaper"] = "auto"
    clock = getattr(args, "clock", None)
    changes.update(clock_for_overrides(scenario, clock, dilated=args.tdf is not None,
                                       changed=bool(changes)))
    if changes:
        scenario = replace(scenario, **changes)
    scenario, notes = shorten(scenario, requests=args.requests, duration_s=args.duration)
    scenario, clock_notes = resolve_clock(scenario, clock)
    notes += clock_notes
    if args.policies:
        wanted = [p.strip() for p in args.policies.split(",") if p.strip()]
        arms = chosen_arms(wanted, arms)
        notes.append(f"only the arms {', '.join(wanted)}")
    return scenario, arms, notes


def chosen_arms(wanted: list[str], arms: tuple) -> tuple:
    """`--policies`: the scenario's arms by label; a registered router policy the scenario
    does not list (a plug-in's included) runs as a default arm of its own."""
    from orchestrator.scenario.arms import parse_arm
    from router.policies import POLICIES

    known = {a.label: a for a in arms}
    bad = [p for p in wanted if p not in known and p not in POLICIES]
    if bad:
        raise ValueError(f"--policies: {', '.join(map(repr, bad))} is neither an arm of the "
                         f"scenario ({', '.join(known)}) nor a registered policy "
                         f"({', '.join(POLICIES)})")
    return tuple(known[p] if p in known else parse_arm(p) for p in wanted)


def _options(args: argparse.Namespace, scenario: Any = None) -> Any:
    from .run.runner import RunOptions

    repeat = args.repeat if args.repeat is not None else getattr(scenario, "repeat", 1)
    if not is_number(repeat, integer=True) or repeat < 1:
        raise ValueError(f"--repeat must be a whole number >= 1, got {repeat!r}")
    return RunOptions(quality_windows=args.quality_windows,
                      overhead_requests=args.overhead_requests, slo_ms=args.slo_ms,
                      quiet=args.quiet, repeat=repeat, trace=_trace(args, scenario),
                      force=bool(getattr(args, "force", False)),
                      link_probe=not getattr(args, "no_link_probe", False))  # a run flag


def _trace(args: argparse.Namespace, scenario: Any) -> Any:
    """The --trace file, checked against the scenario's model (ValueError naming it)."""
    if getattr(args, "trace", None) is None:
        return None
    from moe.profiles import get

    from .run.routing import load_trace

    if scenario.model.mode != "modeled":
        raise ValueError(f"--trace {args.trace}: only a modeled run routes by a trace (the "
                         f"scenario's model {scenario.model.name} runs real weights, whose "
                         f"gate decides); give model: {{name: ..., mode: modeled}}")
    trace = load_trace(args.trace)
    prof = get(scenario.model.name)
    trace, dropped = trace.fit_layers(prof.layers, prof.dense_layers, prof.leading_dense_layers,
                                      prof.name)
    if dropped:
        print(f"moemesh run: --trace {dropped}", file=sys.stderr)
    trace.check(prof.layers, prof.experts, prof.top_k, prof.name)
    return trace


def warn_unfaithful(folder: Path, command: str = "moemesh run") -> bool:
    """Print a warning on stderr when the run in `folder` is not faithful (its summary.json
    says why); True when it printed one."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if summary.get("faithful", True):
        return False
    reasons = summary.get("unfaithful_reasons") or ["(no reason recorded)"]
    print(f"{command}: WARNING: {folder} is not a faithful run; it measured the host as well "
          f"as the emulated mesh:", file=sys.stderr)
    for reason in reasons:
        print(f"  - {reason}", file=sys.stderr)
    return True


def _run(args: argparse.Namespace) -> int:
    """run a scenario: every policy on the same seeded workload, then a report

    Start the scenario's mesh, run each router policy on the same seeded workload (queues and
    caches reset in between), score quality, measure the emulator's overhead, stop the mesh, and
    write tokens.csv, requests.csv, run.json, summary.json, report.md and plots into --out.
    """
    from .run.live import open_live
    from .run.runner import run_experiment

    resume = None
    if args.resume is not None:
        from .run.resume import load

        if args.capacity:
            raise ValueError("--resume: not with --capacity (rerun the capacity ladder; each "
                             "load's run folder is complete or redone)")
        if args.out is not None and args.out.resolve() != args.resume.resolve():
            raise ValueError(f"--resume {args.resume} and --out {args.out}: the run resumes "
                             f"in its own folder; drop --out")
        resume = load(args.resume)
        args.out = args.resume
        if args.scenario is None:  # the scenario file and flags the run was made with
            args = _recorded(args, resume)
    elif args.scenario is None:
        raise ValueError("give a SCENARIO file (or --resume DIR to finish a stopped run)")
    if ladder_of(args) is not None:
        return _capacity(args)
    if args.clock == "both":
        return _both(args)
    scenario, arms, notes = _prepare(args)
    options = _options(args, scenario)
    out = args.out or Path("results") / scenario.name
    t0 = time.monotonic()
    run_clocked(run_experiment(scenario, arms, open_live, out, options, notes=notes,
                               resume=resume, command=_command(args)), scenario)
    print(f"moemesh run: {scenario.name} done in {time.monotonic() - t0:.0f} s: "
          f"{out / 'report.md'}, {out / 'summary.json'}")
    warn_unfaithful(out)
    return 0


def _both(args: argparse.Namespace) -> int:
    """`--clock both`: the scenario in virtual time, then on the wall clock (--tdf, else the
    scenario's dilation), and the paired comparison of the two (experiments.run.crosscheck)."""
    from .run.crosscheck import crosscheck, crosscheck_lines, write_crosscheck
    from .run.live import open_live
    from .run.runner import run_experiment

    base = args.out or Path("results") / f"{args.scenario.stem}-clocks"
    for clock in ("virtual", "realtime"):
        one = argparse.Namespace(**{**vars(args), "clock": clock,
                                    "tdf": args.tdf if clock == "realtime" else None})
        scenario, arms, notes = _prepare(one)
        options = _options(one, scenario)
        t0 = time.monotonic()
        run_clocked(run_experiment(scenario, arms, open_live, base / clock, options,
                                   notes=notes), scenario)
        print(f"moemesh run: {scenario.name} in {clock} time done in "
              f"{time.monotonic() - t0:.0f} s: {base / clock / 'report.md'}")
    data = crosscheck(base / "virtual", base / "realtime")
    path = write_crosscheck(base, data)
    print("\n".join(crosscheck_lines(data)))
    print(f"moemesh run --clock both: {path}")
    warn_unfaithful(base / "realtime")
    return 0


# the flags that decide what a run is (recorded in run.json `command` for --resume)
_RECORDED = ("runtime", "shaper", "clock", "requests", "duration", "policies", "quality_windows",
             "overhead_requests", "slo_ms", "repeat", "tdf", "trace", "no_link_probe")


def _command(args: argparse.Namespace) -> dict[str, Any]:
    flags = {k: getattr(args, k) for k in _RECORDED}
    flags["trace"] = None if flags["trace"] is None else str(Path(flags["trace"]).resolve())
    return {"scenario_file": str(Path(args.scenario).resolve()), "flags": flags}


def _recorded(args: argparse.Namespace, meta: RunMeta) -> argparse.Namespace:
    """`args` with the scenario file and flags of run.json `command`."""
    cmd = meta.command
    if not isinstance(cmd, dict) or not isinstance(cmd.get("flags"), dict):
        raise ValueError(f"--resume {args.resume}: run.json does not record the command the "
                         f"run was made with; give its SCENARIO and flags again")
    flags = {k: cmd["flags"].get(k) for k in _RECORDED}  # a flag newer than the run: None
    if flags["trace"] is not None:
        flags["trace"] = Path(flags["trace"])
    return argparse.Namespace(**{**vars(args), **flags,
                                 "scenario": Path(cmd["scenario_file"])})


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: not a comma-separated list of numbers: {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


def ladder_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """run_capacity's keywords (loads, target, requests) from --capacity, --loads,
    --slo-target and --requests; None without --capacity, where --loads is bad input."""
    from .capacity import CAPACITY_REQUESTS

    if not args.capacity:
        if args.loads:
            raise ValueError("--loads: only with --capacity")
        return None
    if args.duration is not None:
        raise ValueError("--duration: not with --capacity (every load sends --requests N)")
    requests = CAPACITY_REQUESTS if args.requests is None else args.requests
    if requests < 1:
        raise ValueError(f"--requests must be >= 1, got {requests}")
    if not 0 < args.slo_target <= 1:
        raise ValueError(f"--slo-target must be in (0, 1], got {args.slo_target:g}")
    return {"loads": _numbers(args.loads, "--loads") if args.loads else None,
            "target": args.slo_target, "requests": requests}


def prepare_ladder(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """The scenario, its capacity arms and notes for a ladder: --requests counts each load's
    requests (not the scenario's), and --tdf is the dilation the ladder scales from."""
    from dataclasses import replace

    from .capacity import capacity_arms

    scenario, arms, notes = _prepare(argparse.Namespace(**{**vars(args), "requests": None}))
    if args.tdf is not None:  # the flag's dilation is the base, not the scenario's capacity's
        scenario = replace(scenario, capacity=replace(scenario.capacity, time_dilation=None))
    return scenario, capacity_arms(arms, scenario, chosen=bool(args.policies)), notes


def _capacity(args: argparse.Namespace) -> int:
    """`moemesh run --capacity` (experiments.capacity)."""
    from dataclasses import replace

    from .capacity import capacity_lines, run_capacity
    from .run.live import open_live

    ladder = ladder_of(args)
    assert ladder is not None
    scenario, arms, notes = prepare_ladder(args)
    options = replace(_options(args, scenario), quality_windows=0)
    out = args.out or Path("results") / f"{scenario.name}-capacity"
    data = run_clocked(run_capacity(scenario, arms, open_live, out, options,
                                    notes=[*notes, "capacity mode: no quality scoring"],
                                    **ladder), scenario)
    print(f"moemesh run --capacity: {scenario.name} done in {data['wall_s']:.0f} s; max "
          f"throughput at SLO ({options.slo_for(scenario):g} ms, {args.slo_target:.0%} of "
          f"requests):")
    for line in capacity_lines(data):
        print("  " + line)
    print(f"  {out / 'capacity.md'}, {out / 'capacity.png'}")
    for point in data["points"]:
        warn_unfaithful(out / point["folder"], "moemesh run --capacity")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report.report import build_report

    if args.slo_ms is not None and not args.slo_ms > 0:
        raise ValueError(f"--slo-ms must be > 0, got {args.slo_ms:g}")
    from .report.plots import FORMATS, formats

    chosen = FORMATS if args.format == "both" else (args.format,)
    if (args.folder / "capacity.json").is_file():  # a `moemesh run --capacity` folder
        from .capacity import rebuild_capacity

        with formats(*chosen):
            rebuild_capacity(args.folder, slo_ms=args.slo_ms)
        print(f"moemesh report: {args.folder / 'capacity.md'}")
        return 0
    with formats(*chosen):
        build_report(args.folder, slo_ms=args.slo_ms)
    print(f"moemesh report: {args.folder / 'report.md'}")
    warn_unfaithful(args.folder, "moemesh report")
    return 0


def _trace_export(args: argparse.Namespace) -> int:
    from .run.routing import export_trace

    out = args.out or args.folder / "trace.jsonl"
    n = export_trace(args.folder, out, args.policy, args.rep)
    print(f"moemesh trace export: {n} positions to {out}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from .run.live import open_live
    from .run.outdir import claim_out, finish_out
    from .run.runner import run_experiment
    from .sweep import DEFAULT_VALUES, apply_knob, write_sweep

    scenario, arms, notes = _prepare(args)
    options = _options(args, scenario)
    if args.values:
        values = _numbers(args.values, "--values")
    else:
        values = [float(v) for v in DEFAULT_VALUES[args.knob]]
    points = [(v, apply_knob(scenario, args.knob, v)) for v in values]  # check all first
    out = args.out or Path("results") / f"{scenario.name}-sweep-{args.knob}"
    claim_out(out, force=options.force, scenario=scenario.name,  # never over data
              resume=bool(args.resume))  # --resume: its own folder, kept
    done = []
    for value, point in points:
        folder = out / f"{args.knob}={value:g}"
        resume = None
        if args.resume and (folder / "run.json").is_file():  # finished: redrawn; else resumed
            from .run.resume import load

            resume = load(folder)
        run_clocked(run_experiment(point, arms, open_live, folder, options,
                                   notes=[*notes, f"sweep point {args.knob}={value:g}"],
                                   resume=resume), point)
        done.append((value, json.loads((folder / "summary.json").read_text())))
        warn_unfaithful(folder, "moemesh sweep")
    plot = write_sweep(out, args.knob, done, slo_ms=options.slo_for(scenario))
    finish_out(out, ok=True)
    print(f"moemesh sweep: {out / 'sweep.md'}, {plot}")
    return 0
