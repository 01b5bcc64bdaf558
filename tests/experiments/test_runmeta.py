"""run.json's one typed record: what the runner writes is what every reader reads, in the key
order run.json has always had, with the keys a run only has when something happened left out
when empty."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from experiments.run.runmeta import RunMeta, jsonable

# run.json's keys as the runner wrote them before the record (tiny-quick, virtual time):
# the record must keep this order, so old and new folders diff cleanly
WRITTEN = ["format", "scenario", "description", "model", "model_mode", "seed", "time_dilation",
           "slo_ms", "warmup_s", "quality_budget_pct", "arms", "workload", "heldout_sha256",
           "notes", "started", "host", "scenario_data", "scenario_sha256", "claims", "runtime",
           "shaper", "clock", "virtual_speedup", "placements", "faults", "quality", "timings",
           "overhead", "load", "trace", "options", "run_id", "repeats", "command",
           "clock_stats", "parts", "dense", "batching", "fidelity"]
OPTIONAL = {"command", "calibration", "resumed", "clock_stats", "parts", "error", "dense",
            "batching", "fidelity", "runtime_notes", "loop_lag", "node_deaths", "versions",
            "lock_sha256"}


def full() -> RunMeta:
    """A record with every optional part filled, as a resumed virtual run with a death has."""
    return RunMeta(scenario="s", arms=({"label": "a", "policy": "greedy"},), seed=3,
                   notes=("n",), claims=({"metric": "mean_latency"},), clock="virtual",
                   virtual_speedup=2.5, command={"flags": {}}, calibration={"reason": "r"},
                   resumed=({"at": "t", "kept": ["a"], "commit": None},),
                   clock_stats={"advances": 4}, parts={"planned": ["a"], "done": ["a"]},
                   error="FaultError: x", dense={"a": {"mode": "home"}},
                   batching={"mode": "none", "arms": []}, fidelity={"configured": {}},
                   runtime_notes=("note",), loop_lag={"a": {"n1": {"p99_ms": 1.0}}},
                   node_deaths={"a": [{"node": "n1"}]}, versions={"torch": "2.13.0"},
                   lock_sha256="0" * 64)


def test_what_the_runner_writes_reads_back_as_the_same_record() -> None:
    meta = full()
    data = meta.to_json()
    assert json.loads(json.dumps(data)) == data  # plain JSON all through
    assert RunMeta.from_json(data) == meta
    assert set(data) == {f.name for f in fields(RunMeta)} - {"extra"}


def test_the_keys_keep_run_jsons_order_and_optional_ones_are_left_out_empty() -> None:
    meta = full()
    order = [k for k in meta.to_json() if k in WRITTEN]
    assert order == WRITTEN
    bare = RunMeta(scenario="s", arms=()).to_json()
    assert not OPTIONAL & set(bare)  # nothing happened: none of them
    assert set(bare) == set(WRITTEN) - OPTIONAL
    # always written, null included: a reader can tell "none" from "not recorded"
    assert bare["overhead"] is None and bare["trace"] is None and bare["virtual_speedup"] is None
    assert {f.name for f in fields(RunMeta) if f.metadata.get("optional")} == OPTIONAL


def test_an_old_run_json_reads_with_defaults_and_keeps_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"scenario": "s", "arms": [{"label": "a"}], "seed": 2,
                                "old_key": [1]}))
    meta = RunMeta.read(path)
    assert meta.seed == 2 and meta.clock == "realtime" and meta.parts is None
    assert meta.loop_lag == {} and meta.extra == {"old_key": [1]}
    assert meta.to_json()["old_key"] == [1]
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"run\.json is not JSON"):
        RunMeta.read(path)
    with pytest.raises(ValueError, match="field 'clock_stats' must be an object"):
        RunMeta.from_json({"scenario": "s", "arms": [], "clock_stats": [1]})


def test_jsonable_says_in_json_what_json_has_no_word_for() -> None:
    value = {1: (np.float32(0.5), np.int64(3)), "a": np.arange(2), "nan": math.nan,
             "inf": np.float64("inf"), "p": Path("x")}
    assert jsonable(value) == {"1": [0.5, 3], "a": [0, 1], "nan": None, "inf": None, "p": "x"}
