"""A dense part off the home repeats to the bit in virtual time where the mesh's servers sit
behind access links (fg-access: every send of a server shares its 4 Mbit/s uplink). There
several hops leave one node at one emulated instant, and the order they take its uplink
decides when each arrives; booked in the order the host delivered the concurrent
`POST /v1/hop`s, two runs of one seed differed:

- the moving aggregation server: a layer's rows leave a remote aggregation server for its
  expert servers together (from the first token on; router.aggregate books them in the
  plan's order);
- EdgeShard's pipeline: two requests' answers leave one batch on a stage, and both rows hop
  on from it (a token 1.024 ms late, one 512-byte row on the uplink; the node books the hops
  of one instant in one order, services.links.Links.book_hop). At 12 s two requests' rows
  left one stage for the same next stage at one instant, alike in time, peer and bytes: their
  order came from the host until each hop named its request (`order`, HOME/SEED)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, moemesh_process

FG_ACCESS = ROOT / "experiments" / "scenarios" / "fg-access.yaml"
HOST_ONLY = {"dense_host_ms"}  # the host's own time, measured beside the timeline


def _twice(tmp_path: Path, scenario: Path, arm: str, duration: str = "6s") -> list[Path]:
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        done = moemesh_process("run", str(scenario), "--duration", duration, "--quality-windows",
                               "0", "--policies", arm, "--quiet", "--out", str(out))
        assert done.returncode == 0, done.stdout + done.stderr
        outs.append(out)
    return outs


def _same(outs: list[Path]) -> list[dict[str, str]]:
    first, second = _rows(outs[0]), _rows(outs[1])
    assert len(first) >= 100 and all(r["status"] == "ok" for r in first)
    diff = [(i, k, a[k], b[k]) for i, (a, b) in enumerate(zip(first, second, strict=True))
            for k in a if a[k] != b[k]]
    assert not diff, f"{len(diff)} values differ, the first: {diff[:3]}"
    return first


def _rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "tokens.csv").open() as fh:
        return [{k: v for k, v in r.items() if k not in HOST_ONLY} for r in csv.DictReader(fh)]


@pytest.mark.slow
def test_a_moving_aggregation_server_behind_an_uplink_repeats_to_the_bit(tmp_path: Path
                                                                          ) -> None:
    outs = _twice(tmp_path, FG_ACCESS, "hetroute-moving")
    _same(outs)
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["clock"] == "virtual"
    assert run["dense"]["hetroute-moving"]["mode"] == "aggregate"


@pytest.mark.slow
def test_a_pipeline_behind_uplinks_repeats_to_the_bit(tmp_path: Path) -> None:
    text = FG_ACCESS.read_text()
    start, end = text.index("\npolicies:\n"), text.index("\nworkload:")
    scenario = tmp_path / "piped.yaml"
    scenario.write_text(
        (text[:start] + "\npolicies:\n  - {label: edgeshard, policy: greedy, placement: "
         "edgeshard, dense: pipeline}\n" + text[end:text.index("\nclaims:")]).replace(
            "topologies/", str(FG_ACCESS.parent / "topologies") + "/"))
    outs = _twice(tmp_path, scenario, "edgeshard", "12s")
    _same(outs)
    run = json.loads((outs[0] / "run.json").read_text())
    assert run["dense"]["edgeshard"]["mode"] == "pipeline"
