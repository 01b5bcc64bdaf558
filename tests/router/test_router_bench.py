"""`moemesh bench router --json`: the output has the agreed shape (figures come from the bench,
not from here; this only checks the contract with a few samples)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.commands import register
from bench.router import main
from router.policies import POLICIES


@pytest.mark.slow
def test_bench_json_shape(capsys) -> None:
    assert main(as_json=True, samples=20, gap_instances=5, dispatch_s=0.3) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(r["policy"], r["top_k"], r["nodes"]) for r in out["plans"]} == {
        (p, k, n) for p in POLICIES for k in (2, 4, 8) for n in (10, 16)}
    for r in out["plans"]:
        assert 0 < r["p50_us"] <= r["p99_us"]
    assert out["dispatch_per_s"] > 0
    assert out["beam_gap"]["instances"] == 5
    assert isinstance(out["targets_met"], bool)


def test_bench_router_is_a_subcommand() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "router", "--json", "--quick"])
    assert args.json and args.quick and callable(args.handler)
