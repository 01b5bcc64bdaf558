"""A run's `--out` folder: claimed before anything is written, never over another run's data.

`claim_out` runs before a run writes anything. The folder may be new or empty (it is marked
as a run folder, `orchestrator.markers`, with the run's id and `status: running`), or a
folder moemesh marked as a run folder earlier: then the run refuses, naming what is there,
unless `force` (the earlier run's folder is deleted first; nothing unmarked ever is). A
non-empty folder without the marker (someone's data, or a run from before markers) is always
refused: pick another `--out`. `finish_out` records how the run ended (`finished` or
`failed`) in the marker, which is what a later refusal reports.

Chosen over writing a new numbered folder beside it: the folder a user names is the one the
report is in, and a refusal costs one flag, where a silent `-2` suffix sends people reading
the old report.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrator.markers import NotOurs, describe, mark, marker, update

__all__ = ["claim_out", "finish_out"]


def claim_out(out: Path, *, force: bool = False, scenario: str = "") -> str:
    """Make `out` this run's folder (see the module docstring); returns the run's id.
    NotOurs (a ValueError: exit 2) when it holds data that is not an earlier run's to
    replace."""
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
        if not force:
            raise NotOurs(
                f"--out {out} holds a {data.get('status', 'earlier')} run "
                f"({data.get('scenario') or 'scenario ?'}, started {data.get('created', '?')}, "
                f"id {data.get('id')}): refusing to overwrite it; give another --out, or "
                f"--force to replace it")
        shutil.rmtree(out)
    return mark(out, "run", status="running", scenario=scenario)


def finish_out(out: Path, ok: bool) -> None:
    """Record in the marker whether the run finished or failed part-way."""
    update(out, status="finished" if ok else "failed")
