"""A policy is announced done only once its part is on disk (issue 38): `kill -9` right after
"(done)" keeps it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from experiments.run.clock import resolve_clock
from experiments.run.live import open_live
from experiments.run.parts import PART_FILE, RunFolder
from experiments.run.progress import RunProgress
from experiments.run.runner import RunOptions, run_experiment, shorten
from netem.virtual import run_on_clock
from orchestrator.scenario.arms import load_experiment
from tests.helpers import ROOT

QUICKSTART = ROOT / "experiments" / "scenarios" / "tiny-quick.yaml"  # tiny-moe: quick


@pytest.mark.slow
def test_done_is_printed_after_the_part_is_committed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    scenario, arms = load_experiment(QUICKSTART)
    scenario, _ = shorten(scenario, duration_s=3.0)
    scenario, _ = resolve_clock(replace(scenario, faults=()))
    arms = tuple(a for a in arms if a.label in ("local-first", "hetroute"))
    out = tmp_path / "run"
    seen: list[tuple[str, bool]] = []
    end_arm = RunProgress.end_arm

    def check_on_disk(self: RunProgress) -> None:
        label = self.lines[-1].label
        part = RunFolder(out).path(label) / PART_FILE
        seen.append((label, part.is_file() and RunFolder(out).done(label)))
        end_arm(self)

    monkeypatch.setattr(RunProgress, "end_arm", check_on_disk)
    run_on_clock(run_experiment(scenario, arms, open_live, out,
                                RunOptions(quality_windows=0, quiet=True)), virtual=True)
    assert [label for label, _ in seen] == ["local-first", "hetroute"]
    assert all(on_disk for _, on_disk in seen), seen
