"""A run's `--out` folder: claimed before anything is written, never over another run's data.

`claim_out` runs before a run writes anything. The folder may be new or empty (it is marked
as a run folder, `netem.markers`, with the run's id and `status: running`), or a
folder moemesh marked as a run folder earlier: then the run refuses, naming what is there,
unless `force` (the earlier run's output is deleted first: what `finish_out` listed as the
run's, so a file put there since stays; the whole folder where the run was killed before it
ended; nothing unmarked ever is). A
non-empty folder without the marker (someone's data, or a run from before markers) is always
refused: pick another `--out`. `finish_out` records how the run ended (`finished` or
`failed`) in the marker, which is what a later refusal reports; a marker still `running`
whose process is gone is an interrupted run, and one whose process runs is refused even with
`force`. `moemesh run --resume DIR` takes an earlier run's folder over instead (keeping
what it holds).

Chosen over writing a new numbered folder beside it: the folder a user names is the one the
report is in, and a refusal costs one flag, where a silent `-2` suffix sends people reading
the old report.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from netem.markers import (
    MANIFEST,
    MARKER,
    NotOurs,
    describe,
    mark,
    marker,
    owner_alive,
    record,
    recorded,
    remove_recorded,
    restore,
    update,
)

__all__ = ["claim_out", "finish_out", "hand_back", "prior_claim"]


def claim_out(out: Path, *, force: bool = False, scenario: str = "", resume: bool = False
              ) -> str:
    """Make `out` this run's folder (see the module docstring); returns the run's id.
    NotOurs (a ValueError: exit 2) when it holds data that is not an earlier run's to
    replace. `resume` (`moemesh run --resume`): the earlier run's folder is taken over, its
    files kept and its id too, unless a run in progress is writing it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotOurs(f"--out {out} is a file, not a folder: refusing to overwrite it")
    if out.exists() and any(out.iterdir()):
        data = marker(out)
        if data is None:
            raise NotOurs(f"--out {out} was not made by moemesh run (no marker; it holds "
                          f"{describe(out)}): refusing to overwrite it; give another --out "
                          f"(or remove it yourself)")
        if data.get("kind") != "run":
            raise NotOurs(f"--out {out} is a moemesh {data.get('kind')} folder, not a run "
                          "folder: refusing to overwrite it; give another --out")
        status = data.get("status", "earlier")
        alive = status == "running" and owner_alive(data)
        if status == "running" and not alive:
            status = "interrupted (its process is gone)"
        what = (f"({data.get('scenario') or 'scenario ?'}, started {data.get('created', '?')}, "
                f"id {data.get('id')})")
        if alive:  # never pull a folder from under a run that is writing it
            raise NotOurs(f"--out {out} is being written by a run in progress {what}, pid "
                          f"{data.get('pid')}: give another --out")
        if resume:  # experiments.run.resume checks that it is the same run
            return mark(out, "run", run_id=str(data.get("id") or "") or None,
                        status="running", scenario=scenario, kept=data.get("kept") or [])
        if not force:
            raise NotOurs(f"--out {out} holds an earlier run {what}, {status}: refusing to "
                          f"overwrite it; give another --out, or --force to replace it")
        kept = _remove_earlier(out)
        if kept:
            print(f"moemesh: --force kept what the earlier run in {out} did not write: "
                  f"{', '.join(kept[:6])}{' …' if len(kept) > 6 else ''}", file=sys.stderr)
        return mark(out, "run", status="running", scenario=scenario, kept=kept)
    return mark(out, "run", status="running", scenario=scenario)


def _remove_earlier(out: Path) -> list[str]:
    """Remove an earlier run's output for `--force`; returns the names kept. A run that ended
    (finish_out) listed what it wrote in the manifest: only that goes, and a file put there
    since (notes, a paper's figure) stays. A run killed before it ended listed nothing, so
    its folder goes whole, as it always did."""
    names = recorded(out)
    if not names:
        shutil.rmtree(out)
        return []
    return [n for n in remove_recorded(out) if n not in (MARKER, MANIFEST)]


def finish_out(out: Path, ok: bool) -> None:
    """Record in the marker whether the run finished or failed part-way, and in the manifest
    what the run wrote (every entry but those `--force` kept), for a later `--force`."""
    data = marker(out) or {}
    kept = set(data.get("kept") or ()) | {MARKER, MANIFEST, f"{MARKER}.tmp"}
    wrote = [p.name for p in Path(out).iterdir() if p.name not in kept and "\n" not in p.name]
    record(out, *sorted(wrote))
    update(out, status="finished" if ok else "failed")


def prior_claim(out: Path) -> dict | None:
    """The marker `out` holds now (None: none), for `hand_back`."""
    return marker(Path(out))


def hand_back(out: Path, prior: dict | None) -> None:
    """Give back a folder a resume claimed and then refused (another commit, scenario or
    arms): its marker as the stopped run left it, so that it reads as that run again, not as
    one in progress (a retry in the same process would see its own pid and refuse)."""
    if prior:
        restore(Path(out), prior)
