"""`--out`: a run claims its folder before writing, never over another run's data
(experiments.run.outdir)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from experiments.run.outdir import claim_out, finish_out
from experiments.run.runner import RunOptions, run_experiment
from netem.markers import NotOurs, marker, update
from orchestrator.scenario.arms import Arm
from tests.experiments.conftest import small_scenario


def test_a_new_or_empty_folder_is_claimed_and_marked(tmp_path: Path) -> None:
    run_id = claim_out(tmp_path / "new", scenario="s")
    data = marker(tmp_path / "new")
    assert data["kind"] == "run" and data["id"] == run_id and data["status"] == "running"
    (tmp_path / "empty").mkdir()
    claim_out(tmp_path / "empty")
    finish_out(tmp_path / "empty", ok=True)
    assert marker(tmp_path / "empty")["status"] == "finished"


def test_a_rerun_into_a_finished_folder_refuses_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / "run"
    claim_out(out, scenario="quickstart")
    (out / "tokens.csv").write_text("old rows\n")
    (out / "report.md").write_text("old report\n")
    finish_out(out, ok=True)
    with pytest.raises(NotOurs,
                       match=r"holds an earlier run \(quickstart.*\), finished: .*--force"):
        claim_out(out)
    assert (out / "tokens.csv").read_text() == "old rows\n"  # untouched
    claim_out(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [".moemesh-manifest", ".moemesh-marker"]


def test_force_removes_what_the_earlier_run_wrote_and_keeps_a_file_put_there_since(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    claim_out(out, scenario="quickstart")
    (out / "parts").mkdir()
    (out / "parts" / "tokens.csv").write_text("old rows\n")
    (out / "report.md").write_text("old report\n")
    finish_out(out, ok=True)
    (out / "notes.md").write_text("what I saw in this run\n")  # the user's, after the run
    claim_out(out, force=True, scenario="quickstart")
    assert (out / "notes.md").read_text() == "what I saw in this run\n"
    assert not (out / "report.md").exists() and not (out / "parts").exists()
    assert "kept what the earlier run" in capsys.readouterr().err
    (out / "report.md").write_text("new report\n")
    finish_out(out, ok=True)  # the kept file is not the new run's either
    claim_out(out, force=True)
    assert (out / "notes.md").exists() and not (out / "report.md").exists()


def test_force_on_a_run_killed_before_it_ended_replaces_the_folder_whole(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    claim_out(out, scenario="quickstart")
    (out / "tokens.csv").write_text("rows of a run killed hard\n")
    update(out, pid=2**22 + 7)  # its process is gone: interrupted, nothing listed
    claim_out(out, force=True)
    assert not (out / "tokens.csv").exists()


def test_a_folder_moemesh_did_not_make_is_refused_even_with_force(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work\n")
    for force in (False, True):
        with pytest.raises(NotOurs, match=r"not made by moemesh run.*thesis\.tex"):
            claim_out(out, force=force)
    assert (out / "thesis.tex").read_text() == "years of work\n"
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotOurs, match="is a file"):
        claim_out(tmp_path / "file")


def test_the_runner_refuses_before_starting_anything(tmp_path: Path) -> None:
    """A rerun into a finished folder: refused before placement or any mesh starts; the old
    rows and report stay as they were (no header-only tokens.csv beside an old report)."""
    out = tmp_path / "run"
    claim_out(out, scenario="small")
    (out / "tokens.csv").write_text("old rows\n")
    finish_out(out, ok=True)
    started = []

    def open_mesh(*args: object) -> object:
        started.append(args)
        raise AssertionError("no mesh may start")

    with pytest.raises(NotOurs, match="refusing to overwrite"):
        asyncio.run(run_experiment(small_scenario(), [Arm("greedy", "greedy")], open_mesh,
                                   out, RunOptions(quiet=True)))
    assert started == [] and (out / "tokens.csv").read_text() == "old rows\n"


def test_a_run_in_progress_is_never_replaced_and_an_interrupted_one_says_so(
        tmp_path: Path) -> None:
    live = tmp_path / "live"
    claim_out(live, scenario="s")  # this process: still running
    (live / "tokens.csv").write_text("rows\n")
    with pytest.raises(NotOurs, match="being written by a run in progress"):
        claim_out(live, force=True)
    assert (live / "tokens.csv").exists()
    dead = tmp_path / "dead"
    claim_out(dead, scenario="s")
    (dead / "tokens.csv").write_text("rows\n")
    from netem.markers import update

    update(dead, pid=2**22 + 1, start_ticks=1)  # as after kill -9: no such process
    with pytest.raises(NotOurs,
                       match=r"holds an earlier run .*, interrupted \(its process is gone\)"):
        claim_out(dead)
    claim_out(dead, force=True)
