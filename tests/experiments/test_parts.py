"""The run folder's durable parts as data (no mesh): a part is there whole or not at all, the
top-level files hold the finished parts in run order, a partial folder says what is missing,
and --resume refuses a different run, naming what differs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from experiments.run.parts import OVERHEAD, RunFolder, missing
from experiments.run.resume import check, load
from experiments.run.rows import RequestRow, TokenRow, read_rows
from experiments.run.runmeta import RunMeta
from tests.experiments.conftest import meta_of, token
from tests.helpers import moemesh


def _request(policy: str, i: int) -> RequestRow:
    return RequestRow(policy, i, "edge1", -1, False, 0.1 * i, 0.1 * i, 0.1 * i + 0.05, 8, 2,
                      2, 0, 10.0, 20.0, "")


def _finish(folder: RunFolder, key: str, policy: str, n: int = 3) -> None:
    stream = folder.start(key)
    tokens = [token(policy, i, j, 10.0 + j) for i in range(n) for j in range(2)]
    for i in range(n):  # as the driver hands them over, one request at a time
        stream.add(tokens[2 * i:2 * i + 2])
    folder.finish(key, stream, tokens, [_request(policy, i) for i in range(n)],
                  [{"policy": policy, "request": i} for i in range(n)], {"label": policy})


def test_finished_parts_make_the_top_level_files_in_run_order(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    keys = ["b", "a", OVERHEAD]
    meta = {"scenario": "s", "arms": [{"label": "a"}, {"label": "b"}],
            "parts": {"planned": keys, "done": [], "state": "running"}}
    folder.rebuild(keys, meta)  # before any part: headers only, and run.json
    assert list(read_rows(tmp_path / "tokens.csv", TokenRow)) == []
    _finish(folder, "a", "a")
    stream = folder.start("b")  # in flight when the run is killed
    stream.add([token("b", 0, 0, 5.0)])
    stream.close()  # as the process's end does
    folder.rebuild(keys, meta)
    assert [t.policy for t in read_rows(tmp_path / "tokens.csv", TokenRow)] == ["a"] * 6
    assert folder.partial() == {"b": 1}
    _finish(folder, "b", "b")  # run again from its start: the leftover is replaced
    _finish(folder, OVERHEAD, "a", n=1)
    folder.rebuild(keys, meta)
    assert [t.policy for t in read_rows(tmp_path / "tokens.csv", TokenRow)] == (
        ["b"] * 6 + ["a"] * 6)
    assert len(list(read_rows(tmp_path / "overhead.csv", TokenRow))) == 2
    assert [json.loads(x)["policy"] for x in (tmp_path / "routing.jsonl").read_text()
            .splitlines()] == ["b"] * 3 + ["a"] * 3
    assert folder.partial() == {} and not list(tmp_path.glob(".*.tmp"))
    assert folder.part("a")["label"] == "a"


def test_a_partial_folder_says_what_is_missing_and_why() -> None:
    parts = {"planned": ["a", "b", "c"], "done": ["a"], "state": "running",
             "partial": {"b": 7}}
    gone = missing(meta_of({"parts": parts}))
    assert list(gone) == ["b", "c"]
    assert "stopped before it" in gone["c"] and "--resume" in gone["c"]
    assert "7 token rows streamed" in gone["b"]
    failed = missing(meta_of({"parts": {**parts, "state": "failed"}, "error": "FaultError: x"}))
    assert "FaultError: x" in failed["c"]
    assert missing(meta_of({"scenario": "an older run"})) == {}


def test_resume_refuses_another_commit_scenario_or_arms(tmp_path: Path) -> None:
    data = {"scenario": "s", "host": {"commit": "abc1234"},
            "scenario_data": {"workload": {"requests": 8}},
            "arms": [{"label": "a"}], "options": {"repeat": 1}, "trace": None,
            "parts": {"planned": ["a"], "done": []}}
    old = RunMeta.from_json(data)

    def new(**changes: Any) -> RunMeta:
        return RunMeta.from_json({**data, **changes})

    check(old, new(), tmp_path)  # the same run: fine
    # compared as run.json has them: a tuple the runner holds is the list read back
    check(replace(old, arms=({"label": "a", "nodes": []},)),
          replace(old, arms=({"label": "a", "nodes": ()},)), tmp_path)
    with pytest.raises(ValueError, match="commit differs: the run was made at abc1234, "
                                         "this is def5678"):
        check(old, new(host={"commit": "def5678"}), tmp_path)
    with pytest.raises(ValueError, match=r"scenario differs .* at workload\.requests"):
        check(old, new(scenario_data={"workload": {"requests": 7}}), tmp_path)
    with pytest.raises(ValueError, match=r"policies differ from the run's, at arms"):
        check(old, new(arms=[{"label": "a"}, {"label": "b"}]), tmp_path)
    with pytest.raises(ValueError, match="nothing to resume"):
        load(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"scenario": "s", "arms": []}))
    with pytest.raises(ValueError, match="before runs could be resumed"):
        load(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert load(tmp_path) == old  # a resumable run.json: read as the record
    (tmp_path / "run.json").write_text(json.dumps({**data, "seed": "five"}))
    with pytest.raises(ValueError, match="field 'seed' must be an integer"):
        load(tmp_path)


def test_the_cli_says_what_is_wrong_with_a_resume(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert moemesh("run", "--resume", str(tmp_path)) == 2
    assert "no run.json there" in capsys.readouterr().err
    assert moemesh("run") == 2
    assert "give a SCENARIO" in capsys.readouterr().err
    (tmp_path / "run.json").write_text(json.dumps({"scenario": "s", "arms": [],
                                                   "scenario_data": {}, "parts": {}}))
    assert moemesh("run", "--resume", str(tmp_path), "--capacity") == 2
    assert "not with --capacity" in capsys.readouterr().err
    assert moemesh("run", "--resume", str(tmp_path), "--out", str(tmp_path / "x")) == 2
    assert "drop --out" in capsys.readouterr().err
    assert moemesh("run", "--resume", str(tmp_path)) == 2
    assert "does not record the command" in capsys.readouterr().err


def test_a_resume_keeps_the_runs_no_link_probe() -> None:
    """run.json `command` records --no-link-probe, so `--resume DIR` alone does not probe
    the links a run started without; a run.json from before the flag reads as probed."""
    import argparse

    from experiments.commands import _command, _recorded

    args = argparse.Namespace(scenario=Path("s.yaml"), runtime=None, shaper=None, clock=None,
                              requests=4, duration=None, policies=None, quality_windows=0,
                              overhead_requests=0, slo_ms=None, repeat=None, tdf=None,
                              trace=None, no_link_probe=True, resume=Path("out"))
    cmd = _command(args)
    assert cmd["flags"]["no_link_probe"] is True
    again = _recorded(argparse.Namespace(resume=Path("out")),
                      argparse.Namespace(command=cmd))
    assert again.no_link_probe is True and again.requests == 4
    del cmd["flags"]["no_link_probe"]
    old = _recorded(argparse.Namespace(resume=Path("out")), argparse.Namespace(command=cmd))
    assert not old.no_link_probe


def test_a_refused_resume_hands_the_folder_back_as_the_stopped_run_left_it(
        tmp_path: Path) -> None:
    """A resume refused after its claim (another commit) leaves the marker as it was: a
    retry in the same process (a study's world, run afresh) may then replace the folder,
    where before it saw its own pid 'writing' it and refused."""
    import asyncio

    from experiments.run.outdir import claim_out, finish_out
    from experiments.run.runner import RunOptions, run_experiment
    from netem.markers import marker
    from orchestrator.scenario.arms import load_experiment
    from tests.helpers import ROOT

    scenario, arms = load_experiment(ROOT / "experiments" / "scenarios" / "quickstart.yaml")
    out = tmp_path / "run"
    claim_out(out, scenario=scenario.name)
    (out / "run.json").write_text(json.dumps({
        "scenario": scenario.name, "host": {"commit": "0000000"}, "scenario_data": {},
        "arms": [], "parts": {"planned": ["a"], "done": []}}))
    finish_out(out, ok=False)  # a stopped run, as a Ctrl-C leaves it
    before = marker(out)

    def no_mesh(*_args: Any) -> Any:
        raise AssertionError("a refused resume must not start a mesh")

    old = RunMeta.read(out / "run.json")
    with pytest.raises(ValueError, match="commit differs"):
        asyncio.run(run_experiment(scenario, arms, no_mesh, out, RunOptions(quiet=True),
                                   resume=old))
    assert marker(out) == before
    assert claim_out(out, force=True, scenario=scenario.name)  # afresh, as a study retries
