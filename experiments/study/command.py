"""`moemesh study SCENARIO --topologies N --seeds M`: a scenario across worlds (.run).

    moemesh study experiments/scenarios/fg-access.yaml --topologies 8 --seeds 2
    moemesh study SCENARIO --topologies 2 --seeds 1 --duration 10s --out /tmp/study   # a look
    moemesh study SCENARIO --topologies 8 --seeds 2 --resume --out results/fg-access-study

Every world is a full `moemesh run` in OUT/worlds/<world>/ (its report.md is there), with no
quality scoring and no link probe by default (a study compares latency and traffic; the probe
measures the shaper, the same in every world). `--quality-windows N` scores N held-out windows
in every world and adds each arm's perplexity change against exact, pooled across worlds.
Exit 0 when the study is written, 2 on bad input (a scenario whose topology has no known
generator is bad input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.commandline import add_command

from ..commands import (
    _add_run_flags,
    _options,
    _prepare,
    add_ladder_flags,
    ladder_of,
    prepare_ladder,
)

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "study", _study)
    _add_run_flags(p)
    p.set_defaults(quality_windows=0)
    p.add_argument("--topologies", type=int, default=8, metavar="N",
                   help="topologies to draw, e.g. 8")
    p.add_argument("--seeds", type=int, default=2, metavar="M",
                   help="workload seeds per topology, e.g. 2")
    p.add_argument("--study-seed", type=int, default=1, metavar="S",
                   help="seed the topology and workload seeds are drawn from, e.g. 1")
    p.add_argument("--baseline", metavar="LABEL",
                   help="the arm every other is compared with, e.g. greedy (default: the "
                        "first arm when the scenario states no claims; beside claims, these "
                        "rows are added, exploratory)")
    p.add_argument("--link-probe", action="store_true",
                   help="probe every pair's link in each world (default: not; ~10 s a world)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="study folder, e.g. results/fg-access-study (default: "
                        "results/NAME-study)")
    p.add_argument("--resume", action="store_true",
                   help="continue a study in --out: complete worlds are kept, a stopped one "
                        "runs only what it lacks")
    p.add_argument("--no-run", action="store_true",
                   help="run nothing: draw study.json and study.md from the worlds complete "
                        "in --out (a study still running or stopped), the others listed as "
                        "missing")
    p.add_argument("--capacity", action="store_true",
                   help="each world climbs the capacity ladder as `moemesh run --capacity` "
                        "does (--requests N a load, default 16); the study pools each pair "
                        "of arms' max throughput at the SLO across worlds")
    add_ladder_flags(p)
    p.add_argument("--jobs", type=_positive, metavar="N",
                   help="worlds run at once, each its own mesh in its own process, e.g. 2 "
                        "(default: in virtual time as many as the host has cores and memory "
                        "for, about 4 GiB a world; on the wall clock 1, which it must stay: "
                        "worlds running side by side would distort each other's latencies)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the worlds run: local (this host, --jobs at a time) or ray "
                        "(one Ray task a world on a cluster, one CPU per mesh process; "
                        "docs/cluster.md) (default: local)")
    p.add_argument("--address", metavar="ADDR",
                   help="--executor ray: the cluster's head, e.g. 10.0.0.5:6379 (default: "
                        "RAY_ADDRESS, else the cluster `ray start` made on this host, else "
                        "one started for the study on this host)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text[:40]!r}")
    return value


WORLD_GIB = 4.0  # what one world's mesh may take (ten nodes, their models, the controller)


def _jobs(asked: int | None, scenario: Any, worlds: int) -> int:
    """How many worlds run at once. In virtual time a world's numbers do not depend on what
    else the host runs, so worlds may share it; on the wall clock they may not."""
    if scenario.clock != "virtual":
        if asked not in (None, 1):
            raise ValueError(f"--jobs {asked}: worlds on the wall clock (clock "
                             f"{scenario.clock}) run one at a time, or they distort each "
                             f"other's latencies; give --jobs 1 or run in virtual time")
        return 1
    if asked is not None:
        return asked
    return max(1, min(worlds, os.cpu_count() or 1, int(_available_gib() // WORLD_GIB)))


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return WORLD_GIB  # not known: room for one


@dataclass(frozen=True)
class WorldRunner:
    """Runs one world into its folder (resuming what a stopped study left there). A plain
    object, not a closure, so that `--jobs` can send it to a worker process."""

    arms: Any
    options: Any
    notes: list[str]
    scenario: Any
    gen: Any
    ladder: dict[str, Any] | None = None  # --capacity: run_capacity's loads, target, requests

    def processes(self, world: Any) -> int:
        """The processes the world's run takes: one a node and the controller, or with
        `workers: 1` the controller alone, the mesh inside it (a cluster executor holds a CPU
        for each)."""
        from .worlds import world_scenario

        ws = world_scenario(self.scenario, self.gen, world)
        if ws.workers is None:
            return len(ws.topology.nodes) + 1
        return 1 if ws.workers == 1 else ws.workers + 1

    def __call__(self, world: Any, folder: Path) -> None:
        from .worlds import world_scenario

        ws = world_scenario(self.scenario, self.gen, world)
        resume = None
        if (folder / "run.json").is_file():
            from ..run.resume import load

            try:
                resume = load(folder)
            except ValueError:
                resume = None  # not resumable: run it again from scratch
        try:
            self._once(ws, world, folder, resume)
        except ValueError as exc:  # not the same run (another commit, scenario, arms)
            if resume is None or not str(exc).startswith("--resume"):
                raise
            self._once(ws, world, folder, None)  # refused before it wrote anything: afresh

    def _once(self, ws: Any, world: Any, folder: Path, resume: Any) -> None:
        from ..run.clock import run_clocked
        from ..run.live import open_live
        from ..run.runner import run_experiment

        if self.ladder is not None:  # a capacity world: every ladder folder afresh
            from ..capacity import run_capacity

            run_clocked(run_capacity(ws, self.arms, open_live, folder,
                                     replace(self.options, force=True),
                                     notes=[*self.notes, f"study world {world.name}",
                                            "capacity mode: no quality scoring"],
                                     say=lambda _line: None, **self.ladder), ws)
            return
        run_clocked(run_experiment(ws, self.arms, open_live, folder,
                                   replace(self.options, force=resume is None),
                                   notes=[*self.notes, f"study world {world.name}"],
                                   resume=resume), ws)


def _study(args: argparse.Namespace) -> int:
    """run a scenario over generated topologies and workload seeds; pool each comparison across the
    worlds

    Draw N topologies with the scenario's own generator and M workload seeds (from
    --study-seed), run the scenario in every pair, compare each policy with its baseline inside
    each world (paired by request), and report per comparison the median change, the share of
    worlds where it holds, a hierarchical 95% CI (worlds, then requests) and a forest plot; the
    scenario's pre-registered claims are judged on it. Writes study.json, study.md and
    forest_*.png/.svg into --out.
    """
    from orchestrator.scenario.arms import load_experiment

    from ..run.outdir import claim_out, finish_out
    from .executors import Executor
    from .report import fmt_pct, fmt_ratio, fmt_share, write_study
    from .run import analyse, rows_for, run_worlds, world_done
    from .worlds import draw_worlds, generator_of

    if args.clock == "both":
        raise ValueError("--clock both: not in a study (give virtual or realtime)")
    if args.executor == "ray" and args.jobs is not None:
        raise ValueError("--jobs: not with --executor ray (the cluster's CPUs say how many "
                         "worlds run at once)")
    executor = Executor(args.executor, address=args.address)
    executor.check()
    ladder = ladder_of(args)
    scenario, arms, notes = _prepare(args) if ladder is None else prepare_ladder(args)
    gen = generator_of(scenario)
    worlds = draw_worlds(args.study_seed, args.topologies, args.seeds)
    labels = [a.label for a in arms]
    if executor.kind == "local":
        executor = replace(executor, jobs=_jobs(args.jobs, scenario, len(worlds)))
    claims = [c for c in scenario.claims if c.policy in labels and c.baseline in labels]
    if len(claims) < len(scenario.claims):
        notes.append(f"{len(scenario.claims) - len(claims)} claim(s) name arms left out by "
                     f"--policies: not judged")
    if ladder is None:
        rows = rows_for(claims, labels, args.baseline)
    else:
        from .capacity import capacity_pairs

        pairs = capacity_pairs(labels, args.baseline)
        if claims:
            notes.append(f"{len(claims)} claim(s) not judged: a capacity study compares max "
                         f"throughput at the SLO, which no claim names")
    options = replace(_options(args, scenario), quiet=True, link_probe=args.link_probe,
                      **({} if ladder is None else {"quality_windows": 0}))
    out = args.out or Path("results") / f"{scenario.name}-study"
    t0 = time.monotonic()
    missing: list[str] = []
    if args.no_run:  # read-only on the worlds: no claim on the folder, nothing run
        ran = []
        missing = [w.name for w in worlds if not world_done(out / "worlds" / w.name)]
        worlds = [w for w in worlds if w.name not in missing]
        if not worlds:
            raise ValueError(f"--no-run: no complete world in {out / 'worlds'}")
    else:
        claim_out(out, force=options.force, scenario=scenario.name,
                  resume=bool(args.resume))
        try:
            ran = run_worlds(worlds, out, WorldRunner(arms, options, notes, scenario, gen,
                                                      ladder),
                             quiet=args.quiet, executor=executor)
        except BaseException:
            finish_out(out, ok=False)
            raise
    loaded, _ = load_experiment(args.scenario)
    meta = {"scenario": scenario.name, "scenario_file": str(Path(args.scenario).resolve()),
            "scenario_sha256": loaded.source_sha256, "topologies": args.topologies,
            "seeds": args.seeds, "generator": gen.to_json(), "arms": labels,
            "notes": notes, "wall_s": round(time.monotonic() - t0, 1), "ran": ran,
            "missing_worlds": missing}
    if ladder is not None:
        from .capacity import analyse_capacity

        data = analyse_capacity(out, worlds, pairs, study_seed=args.study_seed, meta=meta)
    else:
        data = analyse(out, worlds, rows, study_seed=args.study_seed, meta=meta)
    path = write_study(out, data)
    if not args.no_run:
        finish_out(out, ok=True)
    for note in data.get("version_notes", ()):
        print(f"moemesh study: {note}", file=sys.stderr)
    for c in data.get("capacity_comparisons", ()):
        lo, hi = c["ci95_ratio"]
        print(f"  {c['policy']} vs {c['baseline']} max throughput at SLO: median "
              f"{fmt_ratio(c['median_ratio'])}, geometric mean {fmt_ratio(c['geomean_ratio'])} "
              f"[{fmt_ratio(lo)}, {fmt_ratio(hi)}] where both passed a load "
              f"({c['worlds_with_ratio']} worlds); higher in {fmt_share(c['share_higher'])} of "
              f"{c['worlds']} worlds (surely in {fmt_share(c['share_surely_higher'])}), lower in "
              f"{fmt_share(c['share_lower'])}")
    for c in data["comparisons"]:
        if c["metric"] == "mean_latency" or c["claim"]:
            lo, hi = c["hier_ci95_pct"]
            print(f"  {c['policy']} vs {c['baseline']} {c['metric']}: median "
                  f"{fmt_pct(c['median_pct'])}, mean {fmt_pct(c['mean_pct'])} [{fmt_pct(lo)}, "
                  f"{fmt_pct(hi)}], significant lower in {_share_lower(c)} of "
                  f"{c['worlds']} worlds" + (f": {c['verdict']}" if c["verdict"] else ""))
    print(f"moemesh study: {len(worlds)} worlds in {data['wall_s']:.0f} s: {path}, "
          f"{out / 'study.json'}", file=sys.stderr if args.quiet else sys.stdout)
    json.dumps(data)  # fail here, not in a reader, if anything is not JSON
    return 0


def _share_lower(c: dict[str, Any]) -> str:
    """The share of worlds where the policy was surely lower than its baseline."""
    from .report import fmt_share

    return fmt_share(c["share_held"] if c["direction"] == "lower" else c["share_reversed"])
