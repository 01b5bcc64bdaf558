"""Check the summary of the CI compose run (docker/ci.sh): the run happened the way it should.

    python3 docker/check_summary.py RESULTS_DIR --expect-shaper app|tc [--expect-runtime swarm]
        [--expect-clock virtual|realtime]   (virtual: the run must also say it was faithful)

Checks: the run used the expected runtime (docker, or swarm for a stack) and says which shaper
it used (the expected one: `app`
on a kernel without sch_netem); every policy's tokens are accounted for (served + failed is
the number of rows of tokens.csv for that policy, and some were served); both faults of
docker/scenarios/ci4.yaml (a link-down and a node-down) are recorded in the report; the report
states the measured base network (its "Base network" section, when the run probed it).
Prints what it checked; exit 1 naming the first failed check.

The fields read are docs/contracts.md's summary.json; `faults` (a list with an "action" each) and
the `policy` column of tokens.csv are what the runner is expected to write: align this file with
experiments/ when the runner lands.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from pathlib import Path


def run_folder(results: Path) -> Path:
    """RESULTS itself, or its one run folder (compose's controller writes results/<UTC start>/)."""
    if (results / "summary.json").is_file():
        return results
    runs = sorted(p for p in results.iterdir() if (p / "summary.json").is_file()) \
        if results.is_dir() else []
    if len(runs) > 1:
        raise AssertionError(f"{results}: {len(runs)} runs ({', '.join(p.name for p in runs)}), "
                             "expected one")
    return runs[0] if runs else results


def check(results: Path, expect_shaper: str, expect_runtime: str = "docker",
          expect_clock: str | None = None) -> list[str]:
    results = run_folder(results)
    summary_path = results / "summary.json"
    if not summary_path.is_file():
        raise AssertionError(f"{summary_path}: missing (did the controller run?)")
    summary = json.loads(summary_path.read_text())
    done = []
    if summary.get("runtime") != expect_runtime:
        raise AssertionError(f"runtime is {summary.get('runtime')!r}, expected "
                             f"{expect_runtime!r}")
    if summary.get("shaper") != expect_shaper:
        raise AssertionError(f"shaper is {summary.get('shaper')!r}, expected {expect_shaper!r}")
    done.append(f"runtime {expect_runtime}, shaper {expect_shaper}")
    if expect_clock is not None:
        if summary.get("clock") != expect_clock:
            raise AssertionError(f"clock is {summary.get('clock')!r}, expected {expect_clock!r}")
        if expect_clock == "virtual" and summary.get("faithful") is not True:
            raise AssertionError(f"a virtual-time run is not faithful: "
                                 f"{summary.get('unfaithful_reasons')}")
        done.append(f"clock {expect_clock}" + (", faithful" if expect_clock == "virtual" else ""))
    rows: Counter[str] = Counter()
    with (results / "tokens.csv").open(newline="") as fh:
        for row in csv.DictReader(fh):
            rows[row["policy"]] += 1
    for name, p in summary["policies"].items():
        served, failed = int(p["tokens"]), int(p["failed_tokens"])
        if served <= 0:
            raise AssertionError(f"policy {name}: no token served")
        if served + failed != rows[name]:
            raise AssertionError(f"policy {name}: {served} served + {failed} failed != "
                                 f"{rows[name]} rows in tokens.csv")
        done.append(f"policy {name}: {served} served + {failed} failed = {rows[name]} tokens")
    actions = {f.get("action") for f in summary.get("faults", [])}
    report = (results / "report.md").read_text() if (results / "report.md").is_file() else ""
    for action in ("link-down", "node-down"):
        if action not in actions and action not in report:
            raise AssertionError(f"fault {action} is not recorded in summary.json or report.md")
    done.append("faults recorded: link-down, node-down")
    if "## Base network" not in report:
        raise AssertionError("report.md does not state the measured base network")
    done.append("base network stated")
    return done


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="check_summary.py")
    parser.add_argument("results", type=Path)
    parser.add_argument("--expect-shaper", choices=["app", "tc"], required=True)
    parser.add_argument("--expect-runtime", choices=["docker", "swarm"], default="docker")
    parser.add_argument("--expect-clock", choices=["virtual", "realtime"])
    args = parser.parse_args(argv)
    try:
        for line in check(args.results, args.expect_shaper, args.expect_runtime,
                          args.expect_clock):
            print(f"check_summary: ok: {line}")
    except (AssertionError, KeyError, ValueError, OSError) as exc:
        print(f"check_summary: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
