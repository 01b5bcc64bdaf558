"""`moemesh bench engine --json`: the output has the agreed shape and positive figures (the
figures themselves come from the bench; this checks the contract with few samples)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.commands import register
from bench.engine import TARGETS, main, summarize

FIGURES = ("inprocess_ms", "mesh_local_ms", "mesh_remote_ms", "echo_ms")


def _check_shape(out: dict) -> None:
    for key in FIGURES:
        assert isinstance(out[key], float) and out[key] > 0, key
    assert set(out["ratios"]) >= {"mesh_local_vs_inprocess", "remote_hop_vs_echo"}
    assert all(v > 0 for v in out["ratios"].values())
    assert out["ratios"]["mesh_local_vs_inprocess"] == pytest.approx(
        out["mesh_local_ms"] / out["inprocess_ms"], rel=1e-2)
    assert out["ratios"]["remote_hop_vs_echo"] == pytest.approx(
        out["mesh_remote_ms"] / out["echo_ms"], rel=1e-2)
    for name in ("inprocess", "mesh_local", "mesh_remote_token", "mesh_remote_hop", "echo"):
        st = out["stats"][name]
        assert set(st) == {"mean_ms", "median_ms", "p90_ms", "n"} and st["n"] > 0, name
    assert out["targets"] == TARGETS
    assert set(out["targets_met"]) == set(TARGETS)


def test_summary_of_samples() -> None:
    out = summarize(inprocess=[1.0, 1.0, 1.0], local=[1.5, 1.5], remote=[3.5, 3.5],
                    echo=[0.4, 0.6], hops_per_token=4.0)
    _check_shape(out)
    assert out["mesh_remote_ms"] == pytest.approx(0.5)  # (3.5 - 1.5) / 4
    assert out["ratios"]["mesh_local_vs_inprocess"] == pytest.approx(1.5)
    assert out["ratios"]["remote_hop_vs_echo"] == pytest.approx(1.0)
    assert out["targets_met"] == {"mesh_local_vs_inprocess": True, "remote_hop_vs_echo": True}
    with pytest.raises(ValueError, match="no remote request"):
        summarize([1.0], [1.0], [1.0], [1.0], hops_per_token=0.0)


def test_bench_engine_is_a_subcommand() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "engine", "--json", "--rounds", "2"])
    assert args.json and args.rounds == 2 and callable(args.handler)


@pytest.mark.slow
def test_bench_engine_json(capsys) -> None:
    assert main(as_json=True, rounds=1, tokens=4, generations=1, echoes=10) == 0
    out = json.loads(capsys.readouterr().out)
    _check_shape(out)
    assert out["hops_per_token"] == 4.0  # tiny-moe: 4 layers, both experts on the other node
    assert out["stats"]["inprocess"]["n"] == 3 and out["stats"]["echo"]["n"] == 10
    assert out["same_tokens"] is True
