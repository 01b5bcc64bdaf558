"""One table of the papers' claims over several run folders, each row beside the folder it
was measured in.

    python3 -m experiments.reproduce.table results/hetroute-paper results/hetroute-paper-capacity

A plain run folder (`moemesh run`) gives the rows of its report's Reproduction section
(`experiments.reproduce.papers`); a capacity folder (`moemesh run --capacity`) the loaded-mesh rows
(`experiments.reproduce.load`). Only the run's raw records are read, as `moemesh report` does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..analysis.metrics import policy_stats
from ..analysis.quality import identical_set
from .load import load_rows
from .papers import ReproRow, reproduction_rows

__all__ = ["folder_rows", "main", "markdown"]

HEAD = ["paper", "comparison", "paper figure", "ours (95% CI)", "difference", "holds",
        "arms / note", "run"]


def folder_rows(folder: Path) -> list[ReproRow]:
    """The claims one run folder (plain or capacity) can check."""
    from ..report.report import load_run, quality_delta  # report imports reproduce

    folder = Path(folder)
    if (folder / "capacity.json").is_file():
        return load_rows(folder)
    meta, tokens, requests, _ = load_run(folder)
    qset = identical_set(meta.quality)
    tok = {name: [t for t in tokens if t.policy == name] for name in meta.labels}
    stats = {}
    for name, rows in tok.items():
        q, source = quality_delta(meta, name, rows, qset)
        stats[name] = policy_stats(name, rows, [r for r in requests if r.policy == name],
                                   warmup_s=meta.warmup_s, slo_ms=meta.slo_ms,
                                   quality_delta_pct=q, quality_source=source)
    return reproduction_rows(meta, stats, tok)


def markdown(folders: Sequence[Path]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for folder in folders:
        for row in folder_rows(folder):
            cells = [c.replace("|", "/") for c in row.cells()] + [f"`{folder}`"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m experiments.reproduce.table",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run or capacity folders")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(markdown(args.folders))
    except (ValueError, KeyError, OSError) as exc:
        print(f"repro_table: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
