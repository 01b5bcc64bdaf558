"""Studies: a scenario's comparisons as distributions across worlds, not one draw of them.

`moemesh study SCENARIO --topologies N --seeds M` runs the scenario in N x M worlds (N
topologies drawn by the scenario's own generator, M workload seeds: experiments.study.worlds), each
a full run in `OUT/worlds/<world>/`, then compares each policy with its baseline inside each
world, paired by request (experiments.analysis.paired: the same bootstrap the report uses), and
pools:

* per world: the change in % and its paired 95% CI (requests resampled);
* the median of the per-world changes, and the share of worlds where the change is
  significant (CI beyond 0) in the claimed direction (and, apart, in the other);
* a hierarchical 95% CI of the mean change across worlds: resample the topologies with
  replacement (a topology's workload seeds travel with it: they share its links and devices,
  so they are not independent draws), then, for every world drawn, one of its own bootstrap
  replicates (its requests resampled). The interval covers both sources of spread: which
  world one lands in, and request-to-request noise inside it;
* a forest plot per comparison (PNG and SVG): every world's change and CI, the pooled mean
  and its interval below.

Quality, where the worlds were scored (`--quality-windows N`): each arm's perplexity change
against `exact` on the identical token set (experiments.analysis.quality), its per-world CI from the
held-out positions resampled, pooled the same way. Exploratory rows: no claim names them.

Comparisons: the pairs of the scenario's pre-registered claims (orchestrator.scenario.claims) when
it states any, else each arm against `baseline` (the first arm by default); a `baseline` named
beside claims adds each other arm against it (a claim's pair read backwards is not added
again), exploratory: judged by nobody; each on
`STUDY_METRICS` (plus a claim's own metric). A claim is judged on the hierarchical CI by the
report's rule (`orchestrator.scenario.claims.judge`): it holds only where it holds across worlds.
Results: `study.json` (worlds, seeds, per-world effects, pooled figures) and `study.md`
(experiments.study.report). A world whose folder holds a complete run is not run again.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.scenario.claims import Claim, judge

from ..analysis.metrics import BOOTSTRAP
from ..analysis.paired import failed_charge, paired_changes
from ..analysis.quality import QualitySet, identical_set
from .executors import Executor
from .levels import LEVELS, level_in_world, pool_level
from .worlds import World

__all__ = ["QUALITY", "STUDY_METRICS", "Row", "WorldsTally", "analyse", "hierarchical_ci",
           "quality_effect", "rows_for", "run_worlds", "world_done", "world_effect"]

STUDY_METRICS = ("mean_latency", "ttft", "decode_latency", "traffic")
QUALITY = "quality"  # an arm's perplexity change against exact (baseline "exact")


@dataclass(frozen=True)
class Row:
    """One comparison of a study: `policy` against `baseline` on `metric`."""

    policy: str
    baseline: str
    metric: str
    claim: Claim | None = None  # the pre-registered claim this row judges, if any

    @property
    def direction(self) -> str:
        """The claimed direction (lower when nothing is claimed: less time, fewer bytes)."""
        return self.claim.direction if self.claim else "lower"


def rows_for(claims: Sequence[Claim], labels: Sequence[str], baseline: str | None = None
             ) -> list[Row]:
    """The study's comparisons (module docstring)."""
    pairs = list(dict.fromkeys((c.policy, c.baseline) for c in claims))
    if baseline is not None or not claims:
        base = baseline or labels[0]
        if base not in labels:
            raise ValueError(f"--baseline: no arm {base!r} (arms: {', '.join(labels)})")
        pairs += [(p, base) for p in labels
                  if p != base and (p, base) not in pairs and (base, p) not in pairs]
    out = []
    for policy, base in pairs:
        mine = {c.metric: c for c in claims if (c.policy, c.baseline) == (policy, base)}
        for m in dict.fromkeys([*STUDY_METRICS, *mine]):
            out.append(Row(policy, base, m, mine.get(m)))
    return out


def world_effect(tokens: Mapping[str, Sequence[Any]], row: Row, seed: int,
                 resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """`row` in one world: change %, CI, requests and the bootstrap replicates."""
    charge = failed_charge(*tokens.values())
    change, reps, n = paired_changes(tokens.get(row.baseline, ()), tokens.get(row.policy, ()),
                                     row.metric, seed=seed, resamples=resamples,
                                     failed_at=charge)
    lo, hi = (np.percentile(reps, [2.5, 97.5]) if len(reps) else (math.nan, math.nan))
    return {"change_pct": float(change), "ci95_pct": (float(lo), float(hi)), "requests": n,
            "replicates": reps}


def quality_effect(qset: QualitySet | None, label: str, seed: int,
                   resamples: int = BOOTSTRAP) -> dict[str, Any]:
    """`label`'s perplexity change against exact in one world: change %, CI from the
    common set's positions resampled, positions, replicates (none where it was not scored)."""
    diffs = np.asarray(qset.diffs.get(label, ()) if qset else (), dtype=float)
    if not len(diffs):
        return {"change_pct": math.nan, "ci95_pct": (math.nan, math.nan), "requests": 0,
                "replicates": np.array([])}
    rng = np.random.default_rng([seed, 0x9A1])
    means = diffs[rng.integers(0, len(diffs), size=(resamples, len(diffs)))].mean(axis=1)
    reps = 100.0 * np.expm1(means)
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return {"change_pct": float(100.0 * math.expm1(diffs.mean())),
            "ci95_pct": (float(lo), float(hi)), "requests": len(diffs), "replicates": reps}


def hierarchical_ci(effects: Sequence[float], replicates: Sequence[np.ndarray],
                    clusters: Sequence[int], *, seed: int = 0, resamples: int = BOOTSTRAP
                    ) -> tuple[float, float, float]:
    """(mean of `effects`, 2.5th and 97.5th percentile) of the mean across worlds under the
    two-stage bootstrap of the module docstring. A world with no replicates contributes its
    point effect in every resample; worlds with a non-finite effect are left out."""
    keep = [i for i, e in enumerate(effects) if math.isfinite(e)]
    if not keep:
        return math.nan, math.nan, math.nan
    eff = np.array([effects[i] for i in keep], dtype=float)
    reps = [replicates[i] if len(replicates[i]) else np.array([effects[i]]) for i in keep]
    names = sorted({clusters[i] for i in keep})
    cl = np.array([names.index(clusters[i]) for i in keep])
    k = len(names)
    rng = np.random.default_rng([seed, 0x57D1])
    picks = rng.integers(0, k, size=(resamples, k))
    total = np.zeros(resamples)
    count = np.zeros(resamples)
    for slot in range(k):
        chosen = picks[:, slot]
        for w, r in enumerate(reps):
            hit = chosen == cl[w]
            draw = r[rng.integers(0, len(r), size=resamples)]
            total += np.where(hit, draw, 0.0)
            count += hit
    means = total / np.maximum(count, 1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(eff.mean()), float(lo), float(hi)


def _significant(lo: float, hi: float, direction: str, min_pct: float = 0.0) -> bool:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False
    return hi < -min_pct if direction == "lower" else lo > min_pct


def _opposite(direction: str) -> str:
    return "higher" if direction == "lower" else "lower"


def pool(row: Row, per_world: Sequence[dict[str, Any]], clusters: Sequence[int], *,
         seed: int) -> dict[str, Any]:
    """The pooled figures of `row` from its per-world effects (module docstring)."""
    effects = [w["change_pct"] for w in per_world]
    finite = [e for e in effects if math.isfinite(e)]
    mean, lo, hi = hierarchical_ci(effects, [w["replicates"] for w in per_world], clusters,
                                   seed=seed)
    m = row.claim.min_effect_pct if row.claim else 0.0
    held = sum(_significant(*w["ci95_pct"], row.direction, m) for w in per_world)
    against = sum(_significant(*w["ci95_pct"], _opposite(row.direction)) for w in per_world)
    n = len(finite)
    return {
        "policy": row.policy, "baseline": row.baseline, "metric": row.metric,
        "direction": row.direction, "claim": row.claim.to_data() if row.claim else None,
        "median_pct": _num(float(np.median(finite)) if finite else math.nan),
        "mean_pct": _num(mean), "hier_ci95_pct": [_num(lo), _num(hi)],
        "worlds": n, "share_held": held / n if n else None,
        "share_reversed": against / n if n else None,
        "verdict": judge(row.claim, lo, hi) if row.claim else None,
        "per_world": [{"world": w["world"], "change_pct": _num(w["change_pct"]),
                       "ci95_pct": [_num(w["ci95_pct"][0]), _num(w["ci95_pct"][1])],
                       "requests": w["requests"]} for w in per_world],
    }


def _num(x: float) -> float | None:
    return round(float(x), 4) if x is not None and math.isfinite(x) else None


def world_done(folder: Path) -> bool:
    """Whether `folder` holds a complete run (summary drawn, no part missing, no error), or a
    capacity ladder climbed to its end (capacity.json is written last)."""
    from ..run.parts import missing
    from ..run.runmeta import RunMeta

    if (folder / "capacity.json").is_file():
        return True
    try:
        meta = RunMeta.read(folder / "run.json")
    except (OSError, ValueError):
        return False
    return (folder / "summary.json").is_file() and not meta.error and not missing(meta)


def analyse(out: Path, worlds: Sequence[World], rows: Sequence[Row], *, study_seed: int,
            meta: Mapping[str, Any]) -> dict[str, Any]:
    """study.json's content from the world folders under `out/worlds` (no rerun)."""
    from ..report.report import load_run

    loaded = []
    for world in worlds:
        folder = out / "worlds" / world.name
        rmeta, tokens, _, _ = load_run(folder)
        loaded.append((world, folder, rmeta, tokens,
                       identical_set(rmeta.quality) if rmeta.quality else None))
    scored = [k for *_, q in loaded if q for k in q.diffs if k != "exact"]
    rows = [*rows, *(Row(k, "exact", QUALITY) for k in dict.fromkeys(scored))]
    per_row: list[list[dict[str, Any]]] = [[] for _ in rows]
    per_level: dict[tuple[str, str], list[dict[str, Any]]] = {}
    world_info = []
    for world, folder, rmeta, tokens, qset in loaded:
        by: dict[str, list[Any]] = {}
        for t in tokens:
            by.setdefault(t.policy, []).append(t)
        summary = json.loads((folder / "summary.json").read_text())
        world_info.append({**world.to_json(), "folder": f"worlds/{world.name}",
                           "wall_s": rmeta.timings.get("total_s"),
                           "commit": rmeta.host.get("commit"),
                           "versions": rmeta.versions,
                           "faithful": summary.get("faithful")})
        for i, row in enumerate(rows):
            eff = (quality_effect(qset, row.policy, rmeta.seed) if row.metric == QUALITY
                   else world_effect(by, row, rmeta.seed))
            per_row[i].append({"world": world.name, **eff})
        for label, mine in by.items():
            for level in LEVELS:
                per_level.setdefault((label, level), []).append(
                    {"world": world.name, **level_in_world(mine, level, rmeta.seed)})
    clusters = [w.topology for w in worlds]
    return {**meta, "study_seed": study_seed, "worlds": world_info,
            "version_notes": version_notes([(w.name, m.versions) for w, _, m, *_ in loaded]),
            "comparisons": [pool(r, per_row[i], clusters, seed=study_seed)
                            for i, r in enumerate(rows)],
            "levels": [pool_level(label, level, ws, clusters, seed=study_seed)
                       for (label, level), ws in per_level.items()
                       if len(ws) == len(worlds)]}


def version_notes(worlds: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """One sentence for each world whose result-changing package versions differ from the
    first world's (study.json `version_notes`): its rows may differ for that reason alone."""
    from orchestrator.lockfile import versions_note

    if not worlds:
        return []
    first, want = worlds[0]
    return [note for name, have in worlds[1:]
            if (note := versions_note(f"world {name} against world {first}", have, want))]


class WorldsTally:
    """The study's progress bar: worlds running, done and failed, and a line per world."""

    def __init__(self, bar: Any, task: Any, quiet: bool) -> None:
        self.bar, self.task, self.quiet = bar, task, quiet
        self.walls: dict[str, float] = {}
        self.running: set[str] = set()
        self.failures: dict[str, str] = {}

    def started(self, name: str, *, retry: bool = False) -> None:
        if name in self.walls or name in self.failures:
            return  # told after it ended (a cluster's news may come late)
        self.running.add(name)
        if retry:
            self.say(f"{name}: started again (its worker died)")
        self._show()

    def finished(self, name: str, wall: float) -> None:
        self.running.discard(name)
        self.walls[name] = wall
        self.say(f"{name}: {wall:.0f} s")
        self.bar.advance(self.task)
        self._show()

    def failed(self, name: str, reason: str) -> None:
        self.running.discard(name)
        self.failures[name] = reason
        self.say(f"{name}: failed: {reason}")
        self._show()

    def note(self, text: str) -> None:
        """A line the study prints even when quiet (a world's environment differed)."""
        self.bar.console.print(f"moemesh study: {text}", highlight=False, soft_wrap=True)

    def say(self, text: str) -> None:
        if not self.quiet:
            self.bar.console.print(text, highlight=False, soft_wrap=True)

    def _show(self) -> None:
        self.bar.update(self.task, description=f"worlds: {len(self.running)} running, "
                                               f"{len(self.walls)} done, "
                                               f"{len(self.failures)} failed")


def run_worlds(worlds: Sequence[World], out: Path, run_one: Callable[[World, Path], None],
               *, quiet: bool = False, executor: Executor | None = None
               ) -> list[dict[str, Any]]:
    """Run every world not complete on disk (`run_one(world, folder)`) where `executor` says
    (default: here, one at a time; `jobs` > 1: each in a worker process, so `run_one` must
    pickle; `ray`: experiments.study.executors), with a rich progress bar; returns per world
    {"world", "ran", "wall_s"} (on Ray also its host and attempts), in the worlds' order. Here
    a world that fails stops the study once the worlds already running have ended; on Ray the
    others finish first (each is resumable)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    executor = executor or Executor()
    todo = [w for w in worlds if not world_done(out / "worlds" / w.name)]
    where: dict[str, dict[str, Any]] = {}
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                  disable=quiet) as bar:
        tally = WorldsTally(bar, bar.add_task("worlds", total=len(worlds),
                                              completed=len(worlds) - len(todo)), quiet)
        if executor.kind == "ray":
            from .executors import run_on_ray

            where = run_on_ray(todo, out, run_one, tally, executor.address)
        elif executor.jobs <= 1:
            for world in todo:
                tally.started(world.name)
                tally.finished(world.name, _timed(run_one, world, out / "worlds" / world.name))
        else:
            _run_pooled(todo, out, run_one, executor.jobs, tally)
    walls = tally.walls
    return [{"world": w.name, "ran": w.name in walls, "wall_s": round(walls.get(w.name, 0.0), 1),
             **where.get(w.name, {})} for w in worlds]


def _timed(run_one: Callable[[World, Path], None], world: World, folder: Path) -> float:
    t0 = time.monotonic()
    run_one(world, folder)
    return time.monotonic() - t0


def _run_pooled(todo: Sequence[World], out: Path, run_one: Callable[[World, Path], None],
                jobs: int, tally: WorldsTally) -> None:
    """The worlds in `jobs` worker processes (spawned: a fresh interpreter, no inherited
    threads or clock); the first failure cancels what has not started and is raised. An
    interrupt (Ctrl-C, SIGTERM) stops it all: no further world starts, and each worker gets one
    SIGINT, so the world it runs stops its mesh as `moemesh run` does on Ctrl-C."""
    import multiprocessing
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn, initializer=_worker_start,
                             initargs=(stop,)) as pool:
        running = {pool.submit(_pooled_world, run_one, w, out / "worlds" / w.name): w
                   for w in todo}
        for world in todo[:jobs]:
            tally.started(world.name)
        queued = list(todo[jobs:])
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_EXCEPTION)
                for fut in done:
                    world = running.pop(fut)
                    if fut.exception() is not None:
                        raise fut.exception()
                    tally.finished(world.name, fut.result())
                    if queued:
                        tally.started(queued.pop(0).name)
        except BaseException as exc:
            stop.set()
            for other in running:
                other.cancel()
            if isinstance(exc, KeyboardInterrupt):
                # no public handle on the workers in 3.11 (Executor.terminate_workers is 3.14's)
                for proc in list(getattr(pool, "_processes", {}).values()):
                    if proc.is_alive():
                        os.kill(proc.pid, signal.SIGINT)
            raise


_stop: Any = None  # in a worker: the study's "start no further world" event


def _worker_start(stop: Any) -> None:
    """A worker's own process group: a Ctrl-C at the terminal reaches only the study, which
    passes one SIGINT on (a second one could cut a mesh's clean-up short)."""
    global _stop
    os.setpgrp()
    _stop = stop


def _pooled_world(run_one: Callable[[World, Path], None], world: World, folder: Path
                  ) -> float | None:
    if _stop is not None and _stop.is_set():
        return None  # the study was interrupted while this world waited in the queue
    return _timed(run_one, world, folder)
