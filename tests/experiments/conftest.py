"""Fixtures for the experiments: scenarios built as data, and run folders of raw records.

`run_folder` writes what `moemesh run` writes before rendering (run.json, tokens.csv,
requests.csv, overhead.csv) from rows drawn with a seeded generator, so report, metrics and
plots can be checked without starting a mesh. The end-to-end runs (real node processes on
loopback) are in test_run_live.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from experiments.run.rows import RequestRow, TokenRow, write_rows
from experiments.run.runmeta import RunMeta
from netem.spec import LinkSpec
from orchestrator.scenario.scenario import IntRange, Scenario, Workload
from orchestrator.scenario.topology import Node, Topology
from services.device import builtin_profiles

TEXT = bytes(range(32, 127)) * 40  # stands in for the held-out corpus in pure-data tests


def small_topology(users: tuple[float, ...] = (3.0, 1.0, 0.0)) -> Topology:
    dev = builtin_profiles()["tiny-edge"]
    nodes = [Node(f"edge{i + 1}", dev, u) for i, u in enumerate(users)]
    return Topology.build(nodes, default=LinkSpec(delay_ms=2.0, rate_mbit=100.0), name="t3")


def small_scenario(**workload: Any) -> Scenario:
    base: dict[str, Any] = {"arrival": "poisson", "rate_rps": 5.0, "duration_s": 20.0,
                            "warmup_s": 2.0, "seed": 3, "prompt_tokens": IntRange(4, 12),
                            "gen_tokens": IntRange(2, 6)}
    base.update(workload)
    return Scenario("small", small_topology(), Workload(**base))


def token(policy: str, request: int, index: int, latency: float, *, ok: bool = True,
          warmup: bool = False, nbytes: int = 1000, mix: tuple[int, ...] = (4, 2, 1, 1, 0),
          done_s: float | None = None, reason: str = "", local: int = 5) -> TokenRow:
    return TokenRow(policy, request, "edge1", index, warmup, "ok" if ok else "failed",
                    "" if ok else (reason or "no_replica"), float(request),
                    (done_s if done_s is not None else float(request) + 0.01 * index)
                    if ok else math.nan, latency if ok else math.nan, nbytes if ok else 0,
                    0, 0, 0.001, *(mix if ok else (0, 0, 0, 0, 0)), 0, local if ok else 0,
                    latency * 0.8 if ok else math.nan)


def make_rows(policy: str, mean_ms: float, n_requests: int = 40, gen: int = 8, seed: int = 0,
              warmup_requests: int = 4, fail_request: int | None = None,
              nbytes: int = 1000) -> tuple[list[TokenRow], list[RequestRow]]:
    """Rows of one policy: per-request mean latency around `mean_ms` (lognormal tokens)."""
    rng = np.random.default_rng(seed)
    tokens, requests = [], []
    for r in range(n_requests):
        warm = r < warmup_requests
        level = mean_ms * float(rng.lognormal(0.0, 0.15))
        rows = []
        for i in range(gen):
            if fail_request == r and i >= gen // 2:
                reason = "link_down" if i == gen // 2 else "after:link_down"
                rows.append(token(policy, r, i, 0.0, ok=False, warmup=warm, reason=reason))
            else:
                lat = level * float(rng.lognormal(0.0, 0.2))
                rows.append(token(policy, r, i, lat, warmup=warm, nbytes=nbytes,
                                  done_s=r * 0.5 + 0.001 * lat * (i + 1)))
        tokens += rows
        ok = sum(t.ok for t in rows)
        requests.append(RequestRow(policy, r, "edge1", -1, warm, r * 0.5, r * 0.5,
                                   r * 0.5 + 0.1, 10, gen, ok, gen - ok, rows[0].latency_ms,
                                   sum(t.latency_ms for t in rows if t.ok), ""))
    return tokens, requests


def write_run(folder: Path, arms: list[dict[str, Any]], tokens: list[TokenRow],
              requests: list[RequestRow], overhead_rows: list[TokenRow] | None = None,
              **meta: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "format": 1, "scenario": "synthetic", "description": "rows drawn for a test",
        "model": "tiny-moe", "model_mode": "real", "seed": 5, "time_dilation": 2.0,
        "slo_ms": 300.0, "warmup_s": 2.0, "quality_budget_pct": 2.0, "arms": arms,
        "workload": "drawn", "runtime": "local", "shaper": "app", "notes": [],
        "scenario_data": {"placement": {"policy": "hetroute", "redundancy": 2.0}},
        "placements": {}, "faults": {}, "quality": {}, "timings": {"total_s": 1.0},
        "overhead": None, "host": {}, "started": "now",
    }
    data.update(meta)
    write_rows(folder / "tokens.csv", tokens, TokenRow)
    write_rows(folder / "requests.csv", requests, RequestRow)
    if overhead_rows is not None:
        write_rows(folder / "overhead.csv", overhead_rows, TokenRow)
    (folder / "run.json").write_text(json.dumps(data))
    return folder


def meta_of(data: dict[str, Any]) -> RunMeta:
    """A run.json record from just the keys a test is about (scenario "s", no arm else)."""
    return RunMeta.from_json({"scenario": "s", "arms": [], **data})


def arm(label: str, policy: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"label": label, "policy": policy or label, "placement": None, "redundancy": None,
            "budget_pct": None, "settings": {}, **extra}


@pytest.fixture
def text() -> bytes:
    return TEXT
