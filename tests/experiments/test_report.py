"""Raw records → summary.json, report.md and plots, and `moemesh report DIR` redrawing them."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from experiments.analysis.metrics import Comparison, PolicyStats, policy_stats
from experiments.analysis.paired import paired_compare
from experiments.commands import register
from experiments.report.headline import headline_lines, why
from experiments.report.report import build_report, quality_delta
from experiments.reproduce.papers import claims
from experiments.run.rows import TokenRow
from experiments.run.runmeta import RunMeta
from tests.experiments.conftest import arm, make_rows, write_run

PNG = b"\x89PNG\r\n\x1a\n"


def _folder(tmp_path: Path) -> Path:
    es_t, es_r = make_rows("edgeshard", 60.0, seed=1, nbytes=3000)
    gr_t, gr_r = make_rows("greedy", 30.0, seed=2, nbytes=1500, fail_request=20)
    hr_t, hr_r = make_rows("hetroute", 20.0, seed=3, nbytes=1000)
    overhead, _ = make_rows("overhead:edgeshard", 5.0, n_requests=6, seed=4)
    faults = {"greedy": [
        {"at_s": 5.0, "started_s": 5.0, "done_s": 5.01, "wall_time": 0.0, "action": "link-down",
         "target": ["edge1", "edge2"], "description": "link-down edge1 edge2 (both ways)",
         "ok": True, "error": "", "detail": {}},
        {"at_s": 9.0, "started_s": 9.0, "done_s": 9.02, "wall_time": 0.0, "action": "link-up",
         "target": ["edge1", "edge2"], "description": "link-up edge1 edge2 (both ways)",
         "ok": True, "error": "", "detail": {}},
        {"at_s": 90.0, "started_s": None, "done_s": None, "wall_time": None,
         "action": "node-down", "target": ["edge3"], "description": "node-down edge3",
         "ok": False, "applied": False, "detail": {},
         "error": "not applied: the workload ended first, at 41.20 s"}]}
    quality = {"exact": {"nll": 1.0, "tokens": 100}, "hetroute": {"nll": 1.01, "tokens": 100},
               "greedy": {"nll": 1.002, "tokens": 100}}
    return write_run(tmp_path / "run", [arm("edgeshard", "greedy", placement="layer-shard"),
                                        arm("greedy"), arm("hetroute")],
                     es_t + gr_t + hr_t, es_r + gr_r + hr_r, overhead,
                     faults=faults, quality=quality,
                     overhead={"arm": "edgeshard", "requests": 6, "links": "zero links"})


def test_the_report_states_how_the_run_was_made_and_what_it_measured(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    summary = build_report(folder)
    assert json.loads((folder / "summary.json").read_text()) == summary
    assert list(summary["policies"]) == ["edgeshard", "greedy", "hetroute"]
    p = summary["policies"]
    assert p["greedy"]["failed_tokens"] == 4 and p["hetroute"]["failed_tokens"] == 0
    assert p["hetroute"]["quality_delta_pct"] == pytest.approx(100 * (math.exp(0.01) - 1), 1e-3)
    assert p["edgeshard"]["latency_ms"]["mean"] > p["greedy"]["latency_ms"]["mean"] > \
        p["hetroute"]["latency_ms"]["mean"]
    text = (folder / "report.md").read_text()
    for fact in ("| runtime | local |", "| shaper (link emulation) | app |", "| time dilation | 2",
                 "Emulator overhead: the first 6 requests", "## Comparisons", "95% CI",
                 "link-down edge1 edge2", "after:link_down",
                 "| greedy | 90 | – | node-down edge3 | not applied: the workload ended first",
                 "## Reproduction",
                 "hetroute vs EdgeShard", "hetroute vs per-expert greedy"):
        assert fact in text, fact
    for name in ("paired.png", "latency_cdf.png", "bars.png", "mix.png", "latency_time.png"):
        assert (folder / name).read_bytes()[:8] == PNG
        assert (folder / name).with_suffix(".svg").read_text().startswith("<?xml")
        assert f"]({name})" in text


def test_reproduction_rows_say_whether_the_direction_holds(tmp_path: Path) -> None:
    text = (build_report(_folder(tmp_path)), (tmp_path / "run" / "report.md").read_text())[1]
    repro = text.split("## Reproduction")[1].split("Where and why we differ")[0]
    es_mean = next(line for line in repro.splitlines()
                   if "mean latency, hetroute vs EdgeShard" in line)
    assert es_mean.split("|")[6].strip() == "yes"  # 60 → 20 ms, clearly lower
    # claims whose arms the run lacks (Prism, redundancy, OrderMoE ...) are left out
    assert "vs Prism" not in repro and "redundancy" not in repro and "OrderMoE" not in repro
    assert len(claims()) > 15


def test_quality_comes_from_scores_or_from_the_budget_spent(tmp_path: Path) -> None:
    rows, _ = make_rows("p", 10.0, n_requests=4, warmup_requests=0)
    meta = RunMeta(scenario="s", arms=())
    q, source = quality_delta(meta, "p", rows)
    assert source == "estimate" and q == pytest.approx(0.1)  # 0.001 spent per token = 0.1%
    scored = replace(meta, quality={"exact": {"nll": 2.0}, "p": {"nll": 2.0}})
    q, source = quality_delta(scored, "p", rows)
    assert (q, source) == (0.0, "measured")


def _cli(argv: list[str]) -> int:
    from services.commandline import bad_input_types as _bad_input_types

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except _bad_input_types():
        return 2


def test_moemesh_report_redraws_from_raw_records(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert not (folder / "summary.json").exists()
    assert _cli(["report", str(folder), "--slo-ms", "25"]) == 0
    text = (folder / "report.md").read_text()
    assert "≤ 25 ms" in text
    assert _cli(["report", str(tmp_path / "nothing-here")]) == 2
    assert _cli(["report", str(folder), "--slo-ms", "-1"]) == 2


def test_every_report_has_the_link_fidelity_table(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    meta = json.loads((folder / "run.json").read_text())
    conf = {"delay_ms": 2.0, "rate_ab_mbit": 100.0, "rate_ba_mbit": 100.0, "jitter_ms": 0.0,
            "loss_pct": 0.0}
    fit = {"delay_ms": 2.1, "rate_mbit": 99.0, "small": 20, "large": 4, "d_out": 50_000,
           "d_in": 50_000, "link_small_ms": 4.2, "link_large_ms": 12.2}
    meta["fidelity"] = {"configured": {"edge1-edge2": conf, "edge1-edge3": conf},
                        "probe": {"edge1-edge2": fit,
                                  "edge1-edge3": {**fit, "delay_ms": 2.5}},
                        "passive": {"edge1-edge2": {"delay_ms": 2.05, "n": 40}}}
    (folder / "run.json").write_text(json.dumps(meta))
    summary = build_report(folder, plots_too=False)
    text = (folder / "report.md").read_text()
    assert "## Link fidelity" in text
    assert ("| edge1-edge2 | 2 | 2.1 | +0.100 | 2.05 (40) | +0.050 | 100 | 99 | -1.00% | ok |"
            in text)
    assert "| edge1-edge3 |" in text and "**off**: probe delay" in text
    assert "1 of 2 pairs off: edge1-edge3." in text
    assert summary["fidelity"]["off"] == ["edge1-edge3"]
    assert summary["fidelity"]["within_limits"] is False
    # a run recorded before the probe still renders, and says so
    del meta["fidelity"]
    (folder / "run.json").write_text(json.dumps(meta))
    summary = build_report(folder, plots_too=False)
    assert "fidelity" not in summary
    assert "Not measured: this run predates the per-pair probe." in (
        folder / "report.md").read_text()


def test_run_json_is_read_as_a_typed_record_old_runs_included(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    data = json.loads((folder / "run.json").read_text())
    meta = RunMeta.from_json(data)
    assert meta.labels == ["edgeshard", "greedy", "hetroute"] and meta.seed == 5
    back = meta.to_json()  # nothing lost (unknown keys included), missing fields defaulted
    assert {k: back[k] for k in data} == data  # as written: the same keys, the same values
    assert meta.loop_lag == {} and "loop_lag" not in back  # an optional field, left out empty
    # a run recorded before most fields existed still renders, with the defaults
    old = {k: data[k] for k in ("scenario", "arms", "seed", "time_dilation")}
    (folder / "run.json").write_text(json.dumps(old))
    build_report(folder, plots_too=False)
    assert "# moemesh run: synthetic" in (folder / "report.md").read_text()
    for bad, says in (({**data, "seed": "five"}, "field 'seed' must be an integer"),
                      ({**data, "faults": [1]}, "field 'faults' must be an object"),
                      ({k: v for k, v in data.items() if k != "arms"}, "'arms' is missing")):
        with pytest.raises(ValueError, match=says):
            RunMeta.from_json(bad)


def test_the_report_says_where_each_arms_dense_part_and_kv_cache_were(tmp_path: Path) -> None:
    """Issue 25 item 3: home-gathering arms are named as such, a pipelined arm's stages and
    the KV cache bytes each of them holds per context token are listed."""
    es_t, es_r = make_rows("edgeshard", 30.0, seed=1)
    hr_t, hr_r = make_rows("hetroute", 20.0, seed=3)
    mv_t, mv_r = make_rows("hetroute-moving", 18.0, seed=5)
    mv_t = [replace(t, kv_bytes=300) for t in mv_t]  # of each token's 1,000 bytes
    dense = {"edgeshard": {"mode": "pipeline", "kv_bytes_per_layer_token": 512,
                           "kv_bytes_per_token_at_home": 2048,
                           "pipelines": [["a", "a", "b", "c"]],
                           "kv_bytes_per_token": [{"a": 1024, "b": 512, "c": 512}]},
             "hetroute": {"mode": "home", "kv_bytes_per_layer_token": 512,
                          "kv_bytes_per_token_at_home": 2048},
             "hetroute-moving": {"mode": "aggregate", "kv_bytes_per_layer_token": 512,
                                 "kv_bytes_per_token_at_home": 2048}}
    folder = write_run(tmp_path / "run", [arm("edgeshard", "greedy", placement="edgeshard",
                                              dense="pipeline"), arm("hetroute"),
                                          arm("hetroute-moving", "hetroute", dense="aggregate")],
                       es_t + hr_t + mv_t, es_r + hr_r + mv_r, dense=dense)
    summary = build_report(folder, plots_too=False)
    assert summary["dense"] == dense
    text = (folder / "report.md").read_text()
    assert "## Where the dense part runs" in text
    assert "the KV cache there, 2048 bytes per context token): hetroute." in text
    assert ("that layer's KV cache, 512 bytes per context token, moving there on the links "
            "and counted as traffic): hetroute-moving." in text)
    assert ("hetroute-moving: 300 bytes of KV cache moved per measured token (30.0% of its "
            "traffic)." in text)
    assert "| edgeshard | 0 | a (0-1) → b (2) → c (3) | a 1024, b 512, c 512 |" in text


def _split(rows: list[TokenRow], link_ms: float) -> list[TokenRow]:
    """The rows with a latency split whose network part is `link_ms` (1 ms of compute, and
    the rest of each token's latency the host's)."""
    return [replace(t, emulated_ms=link_ms + 1.0, overhead_ms=t.latency_ms - link_ms - 1.0,
                    link_ms=link_ms, queue_ms=0.0, load_ms=0.0, compute_ms=1.0, dense_ms=0.0)
            if t.ok else t for t in rows]


def _stats_and_comps(rows: dict[str, list[TokenRow]]) -> tuple[list[PolicyStats],
                                                                list[Comparison]]:
    stats = [policy_stats(name, r, [], warmup_s=2.0) for name, r in rows.items()]
    ref = next(iter(rows))
    comps = [paired_compare(ref, rows[ref], s.name, rows[s.name], m, seed=5)
             for s in stats[1:] for m in ("mean_latency", "traffic")]
    return stats, comps


def test_the_headline_names_the_winner_its_ci_and_the_part_of_the_split() -> None:
    """Issue 40 (1): one sentence per policy against the first: who won, by how much, the
    paired CI, and where in the latency split the difference is."""
    greedy = _split(make_rows("greedy", 30.0, seed=2, nbytes=1500)[0], link_ms=20.0)
    joint = _split(make_rows("hetroute", 20.0, seed=3, nbytes=1000)[0], link_ms=10.0)
    stats, comps = _stats_and_comps({"greedy": greedy, "hetroute": joint})
    lat = next(c for c in comps if c.metric == "mean_latency")
    assert lat.significant and lat.change_pct < -20
    lines = headline_lines(stats, comps)
    assert lines[0].startswith("Each policy against `greedy` (the first listed)")
    (sentence,) = [x for x in lines if x.startswith("- ")]
    assert sentence.startswith(f"- `hetroute` had a {abs(lat.change_pct):.1f}% lower mean "
                               f"token latency than `greedy` (")
    assert (f"paired 95% CI {lat.ci_low_pct:+.1f}% to {lat.ci_high_pct:+.1f}%, "
            f"{lat.n_a} requests)") in sentence
    assert "mostly in the network (network -10.0" in sentence
    assert "; traffic per token -33.3% (paired 95% CI" in sentence
    assert why(stats[0], stats[0]).startswith("spread over the split")  # nothing moved


def test_a_ci_that_holds_zero_reads_no_significant_difference() -> None:
    a = make_rows("greedy", 30.0, seed=2)[0]
    b = make_rows("hetroute", 30.0, seed=9)[0]
    stats, comps = _stats_and_comps({"greedy": a, "hetroute": b})
    lat = next(c for c in comps if c.metric == "mean_latency")
    assert not lat.significant
    (sentence,) = [x for x in headline_lines(stats, comps, faithful=False) if x.startswith("- ")]
    assert sentence.startswith("- `hetroute` against `greedy`: no significant difference in "
                               "mean token latency (")
    assert f"paired 95% CI {lat.ci_low_pct:+.1f}% to {lat.ci_high_pct:+.1f}%" in sentence
    assert " had a " not in sentence  # no winner is named
    assert "no significant difference in traffic per token (+0.0%" in sentence
    assert "not faithful" in headline_lines(stats, comps, faithful=False)[-2]
    assert headline_lines(stats[:1], comps[:0]) == []


def test_the_report_opens_with_the_headline(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    build_report(folder, plots_too=False)
    lines = (folder / "report.md").read_text().splitlines()
    assert lines[0] == "# moemesh run: synthetic"
    verdict = next(i for i, x in enumerate(lines) if "aithful run" in x)
    h = next(i for i, x in enumerate(lines) if x.startswith("Each policy against"))
    assert 2 <= verdict < h < 10  # whether to trust it, then who won, before the tables
    assert lines[h].startswith("Each policy against `edgeshard`")
    assert lines[h + 2].startswith("- `greedy` had a ")
    assert "lower mean token latency" in lines[h + 2]
    assert lines[h + 3].startswith("- `hetroute` had a ")
    assert "the token rows carry no latency split" in lines[h + 3]  # the drawn rows have none
    assert next(i for i, x in enumerate(lines) if x.startswith("| runtime |")) > h + 3
