"""Faithful runs: the latency split, loop lag, quality on the identical token set, and the
summary.json keys that outside checks read."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from experiments.analysis.faithful import NO_SPLIT, assess, loop_lag_of
from experiments.analysis.metrics import policy_stats
from experiments.analysis.quality import identical_set
from experiments.commands import register, warn_unfaithful
from experiments.report.report import build_report
from experiments.run.rows import TokenRow
from tests.experiments.conftest import arm, make_rows, meta_of, write_run


def _split(rows: list[TokenRow], overhead_share: float) -> list[TokenRow]:
    """Rows with a latency split: `overhead_share` of each token is the host's."""
    out = []
    for t in rows:
        if not t.ok:
            out.append(t)
            continue
        over = t.latency_ms * overhead_share
        emu = t.latency_ms - over
        out.append(replace(t, emulated_ms=emu, overhead_ms=over, link_ms=emu * 0.5,
                           queue_ms=emu * 0.1, load_ms=0.0, compute_ms=emu * 0.3,
                           dense_ms=emu * 0.1, dense_host_ms=1.0))
    return out


def _window(nll: list[float | None], failed: list[int]) -> dict[str, Any]:
    return {"home": "edge1", "nll": None, "tokens": len(nll), "failed_tokens": len(failed),
            "failed_positions": failed, "token_nll": nll}


def _quality(greedy_failed: list[int]) -> dict[str, Any]:
    """Two windows of 4 positions; greedy fails `greedy_failed` of window 0 (the hard ones)."""
    exact = [[1.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]]
    het = [[1.1, 1.1, 3.1, 3.1], [2.1, 2.1, 2.1, 2.1]]
    greedy = [[1.0, 1.0, None if 2 in greedy_failed else 3.0,
               None if 3 in greedy_failed else 3.0], [2.0, 2.0, 2.0, 2.0]]
    def entry(values: list[list[float | None]], failed: list[list[int]]) -> dict[str, Any]:
        return {"nll": None, "tokens": 8, "failed_tokens": sum(map(len, failed)),
                "windows": [_window(v, f) for v, f in zip(values, failed, strict=True)]}
    return {"exact": entry(exact, [[], []]), "hetroute": entry(het, [[], []]),
            "greedy": entry(greedy, [greedy_failed, []])}


def _run(tmp_path: Path, *, share: float = 0.02, lag_frac: float = 0.0,
         greedy_failed: list[int] | None = None, split: bool = True) -> Path:
    lr_t, lr_r = make_rows("local-first", 30.0, seed=1)
    gr_t, gr_r = make_rows("greedy", 25.0, seed=2)
    hr_t, hr_r = make_rows("hetroute", 20.0, seed=3)
    if split:
        lr_t, gr_t, hr_t = (_split(r, share) for r in (lr_t, gr_t, hr_t))
    lag = {label: {n: {"p99_ms": 0.8, "max_ms": 2.0, "over_5ms_frac": 0.0, "series": []}
                   for n in ("edge1", "edge2")} for label in ("local-first", "greedy")}
    lag["hetroute"] = {"edge1": {"p99_ms": 1.5, "max_ms": 40.0, "over_5ms_frac": lag_frac,
                                 "series": [[3.0, 40.0]]},
                       "edge2": {"error": "node down"}}  # a fault took it down: no lag
    return write_run(tmp_path / "run", [arm("local-first"), arm("greedy"), arm("hetroute")],
                     lr_t + gr_t + hr_t, lr_r + gr_r + hr_r, loop_lag=lag,
                     quality=_quality(greedy_failed or []))


def test_quality_is_compared_on_the_identical_token_set() -> None:
    q = _quality([2, 3])  # greedy fails the two hard positions of window 0
    s = identical_set(q)
    assert s.comparable and s.scored == 6 and s.excluded == 2
    assert s.failed == {"exact": 0, "hetroute": 0, "greedy": 2}
    # over the common six positions greedy equals exact: not "better than exact"
    assert s.delta_pct("greedy") == pytest.approx(0.0)
    assert s.nll["exact"] == pytest.approx(10.0 / 6)  # exact's hard positions are out too
    assert s.delta_pct("hetroute") == pytest.approx(100 * (math.exp(0.1) - 1))
    # averaging around the failures (the old way) would have made greedy look better
    naive_greedy = (1 + 1 + 2 * 4) / 6
    naive_exact = (1 + 1 + 3 + 3 + 2 * 4) / 8
    assert naive_greedy < naive_exact


def test_the_delta_has_the_standard_error_of_its_paired_positions() -> None:
    """A delta of a fraction of a percent needs enough positions to be told from noise: the
    set gives each label's standard error over the common positions (differences from exact)."""
    exact = [1.0, 2.0, 1.5, 0.5]
    policy = [1.1, 1.9, 1.8, 0.5]  # differences 0.1, -0.1, 0.3, 0.0
    q = {k: {"windows": [{"token_nll": v, "failed_positions": []}]}
         for k, v in (("exact", exact), ("p", policy))}
    s = identical_set(q)
    d = [b - a for a, b in zip(exact, policy, strict=True)]
    mean = sum(d) / 4
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 3 / 4)
    assert s.se["p"] == pytest.approx(se)
    assert s.delta_se_pct("p") == pytest.approx(100 * math.exp(mean) * se)
    assert s.delta_se_pct("exact") == 0.0
    assert math.isnan(identical_set({"p": q["p"]}).delta_se_pct("p"))  # no exact: unknown


def test_an_old_run_with_failures_and_no_positions_is_not_comparable() -> None:
    q = {"exact": {"nll": 2.0, "tokens": 10, "failed_tokens": 0},
         "greedy": {"nll": 1.9, "tokens": 9, "failed_tokens": 1}}
    s = identical_set(q)
    assert not s.comparable and math.isnan(s.delta_pct("greedy"))
    clean = identical_set({"exact": {"nll": 2.0, "tokens": 10, "failed_tokens": 0},
                           "greedy": {"nll": 2.0, "tokens": 10, "failed_tokens": 0}})
    assert clean.comparable and clean.delta_pct("greedy") == 0.0


def test_a_faithful_run_says_so_and_summary_has_the_keys(tmp_path: Path) -> None:
    folder = _run(tmp_path)
    summary = build_report(folder, plots_too=False)
    assert summary["faithful"] is True and summary["unfaithful_reasons"] == []
    assert summary == json.loads((folder / "summary.json").read_text())
    for name, p in summary["policies"].items():
        assert p["overhead_share"] == pytest.approx(0.02, abs=1e-6), name
        assert set(p["emulated_ms"]) >= {"mean", "p99"}
        assert p["emulated_ms"]["mean"] == pytest.approx(0.98 * p["latency_ms"]["mean"],
                                                         rel=1e-3)
        assert set(p["loop_lag_ms"]) >= {"p99", "max"}
        assert p["scoring_failed_tokens"] == 0
        assert set(p["latency_split_ms"]) >= {"link", "queue", "load", "compute", "dense",
                                              "overhead"}
    assert summary["policies"]["hetroute"]["loop_lag_ms"]["max"] == 40.0  # worst node
    comps = summary["comparisons"]
    assert {(c["policy"], c["metric"]) for c in comps} == {
        (p, m) for p in ("greedy", "hetroute")
        for m in ("mean_latency", "p99_latency", "traffic", "ttft", "decode_latency")}
    for c in comps:
        assert c["against"] == "local-first"
        assert set(c) >= {"policy", "against", "metric", "change_pct", "paired_ci_pct"}
        lo, hi = c["paired_ci_pct"]
        assert lo <= c["change_pct"] <= hi
    het = next(c for c in comps if c["policy"] == "hetroute" and c["metric"] == "mean_latency")
    assert het["change_pct"] < 0 and het["paired_ci_pct"][1] < 0
    text = (folder / "report.md").read_text()
    assert text.splitlines()[2].startswith("**Faithful run**")
    for fact in ("## Latency split", "overhead share", "emulated mean", "paired 95% CI",
                 "## Run-to-run spread", "One repetition"):
        assert fact in text, fact


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"share": 0.12}, "overhead share 12.0%"),
    ({"lag_frac": 0.03}, "lagged more than 5 ms for 3.0% of the time"),
    ({"greedy_failed": [2, 3]}, "2 scoring token(s) failed (greedy: 2)"),
    ({"split": False}, NO_SPLIT),
])
def test_an_unfaithful_run_says_why_everywhere(tmp_path: Path, kwargs: dict[str, Any],
                                               reason: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    folder = _run(tmp_path, **kwargs)
    summary = build_report(folder, plots_too=False)
    assert summary["faithful"] is False
    assert any(reason in r for r in summary["unfaithful_reasons"]), summary["unfaithful_reasons"]
    head = "\n".join((folder / "report.md").read_text().splitlines()[:8])
    assert "**Not a faithful run.**" in head and reason in head
    assert warn_unfaithful(folder)
    assert "WARNING" in capsys.readouterr().err
    if kwargs.get("split") is False:
        assert all(p["overhead_share"] is None for p in summary["policies"].values())
    if "greedy_failed" in kwargs:
        p = summary["policies"]
        assert p["greedy"]["scoring_failed_tokens"] == 2
        assert p["hetroute"]["scoring_failed_tokens"] == 0
        # greedy is not averaged around its failures: same set as exact, so no gain
        assert p["greedy"]["quality_delta_pct"] == pytest.approx(0.0)
        assert summary["quality"]["excluded_tokens"] == 2
        assert "Failed scoring tokens" in (folder / "report.md").read_text()


def test_the_flags_follow_the_limits() -> None:
    rows, reqs = make_rows("p", 20.0)
    ok = policy_stats("p", _split(rows, 0.049), reqs)
    over = policy_stats("p", _split(rows, 0.051), reqs)
    assert assess(meta_of({}), [ok]) == (True, [])
    assert not assess(meta_of({}), [over])[0]
    lag = meta_of({"loop_lag": {"p": {"n1": {"p99_ms": 9.0, "max_ms": 9.0, "over_5ms_frac": 0.01}},
                        "p#rep1": {"n1": {"p99_ms": 9.0, "max_ms": 30.0,
                                          "over_5ms_frac": 0.011}},
                        "other": {"n1": {"over_5ms_frac": 0.5}}}})
    good, reasons = assess(lag, [ok])
    assert not good and len(reasons) == 1 and reasons[0].startswith("p#rep1: n1")
    assert loop_lag_of(lag, "p") == {"p99": 9.0, "max": 30.0, "over_5ms_frac": 0.011,
                                     "node": "n1"}
    assert loop_lag_of(meta_of({}), "p") is None
    assert assess(meta_of({}), [ok], {"exact": 1})[1][0].startswith("1 scoring token(s) failed")


def test_no_loop_lag_recorded_is_null_not_a_flag(tmp_path: Path) -> None:
    rows, reqs = make_rows("p", 20.0)
    folder = write_run(tmp_path / "r", [arm("p")], _split(rows, 0.01), reqs)
    summary = build_report(folder, plots_too=False)
    assert summary["faithful"] is True
    assert summary["policies"]["p"]["loop_lag_ms"] is None
    assert summary["comparisons"] == []
    assert "not recorded" in (folder / "report.md").read_text()


def test_repetitions_show_their_spread(tmp_path: Path) -> None:
    rows, reqs = make_rows("a", 20.0, seed=1)
    rows2, reqs2 = make_rows("b", 15.0, seed=2)
    tok, req = [], []
    for rep, scale in enumerate((1.0, 1.1)):
        tok += [replace(t, rep=rep, latency_ms=t.latency_ms * scale) for t in rows + rows2]
        req += [replace(r, rep=rep) for r in reqs + reqs2]
    folder = write_run(tmp_path / "r", [arm("a"), arm("b")], _split(tok, 0.01), req,
                       repeats={"n": 2, "orders": [["a", "b"], ["b", "a"]]})
    summary = build_report(folder, plots_too=False)
    assert summary["repeat"] == 2
    a = summary["policies"]["a"]["repeats"]
    assert len(a["mean_ms"]) == 2 and a["mean_ms"][1] == pytest.approx(1.1 * a["mean_ms"][0],
                                                                       rel=1e-3)
    assert a["spread_pct"] == pytest.approx(100 * 0.1 / 1.05, rel=1e-2)
    text = (folder / "report.md").read_text()
    assert "| policy | rep 0 | rep 1 | spread | CV |" in text and "0: a, b; 1: b, a" in text
    # throughput is per repetition: two repetitions of one workload are not twice the tok/s
    once = build_report(write_run(tmp_path / "once", [arm("a"), arm("b")],
                                  _split([t for t in tok if t.rep == 0], 0.01),
                                  [r for r in req if r.rep == 0]), plots_too=False)
    assert summary["policies"]["a"]["throughput_tok_s"] == pytest.approx(
        once["policies"]["a"]["throughput_tok_s"], rel=1e-3)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_repeat_flag_reaches_the_run_options() -> None:
    from experiments.commands import _options

    args = _parse(["run", "x.yaml", "--repeat", "3"])
    assert _options(args).repeat == 3
    assert _options(_parse(["run", "x.yaml"])).repeat == 1
    with pytest.raises(ValueError, match="--repeat"):
        _options(_parse(["run", "x.yaml", "--repeat", "0"]))


def test_a_dead_node_a_partial_run_and_runtime_notes_reach_the_verdict(tmp_path: Path) -> None:
    """run.json's `node_deaths` (orchestrator.mesh.supervisor), `error`, an unreadable or
    overwritten loop-lag record and the runtime's notes all appear in report.md's verdict."""
    from tests.experiments.conftest import arm, make_rows, write_run

    t, r = make_rows("greedy", 25.0, seed=2)
    lag = {"greedy": {"edge1": {"p99_ms": 1.0, "max_ms": 2.0, "over_5ms_frac": 0.0,
                                "series": [], "lost": True},
                      "edge2": {"error": "GET /v1/looplag: no answer within 30 s"}}}
    folder = write_run(
        tmp_path / "run", [arm("greedy"), arm("hetroute")], t, r, loop_lag=lag,
        node_deaths={"greedy": [{"node": "edge3", "at_s": 12.5, "how": "exited (no fault "
                                 "scheduled)", "log": "logs/edge3.log"}]},
        error="KeyboardInterrupt: ", runtime="swarm", shaper="app",
        runtime_notes=["nodes run on 2 hosts: only tc shapes them faithfully (the app shaper "
                       "times arrivals on each host's own monotonic clock)",
                       "service mm_edge1 has no NET_ADMIN"])
    summary = build_report(folder, plots_too=False)
    reasons = "\n".join(summary["unfaithful_reasons"])
    assert summary["faithful"] is False
    assert "greedy: not faithful: node died: edge3 exited (no fault scheduled) at 12.5 s" \
        in reasons and "logs/edge3.log" in reasons
    assert "the run did not finish (KeyboardInterrupt: )" in reasons and "partial" in reasons
    assert "edge1's event-loop lag record lost samples" in reasons
    assert "edge2's event-loop lag could not be read" in reasons
    assert "runtime: nodes run on 2 hosts" in reasons
    text = (folder / "report.md").read_text()
    head = text[:text.index("| runtime")]
    assert "node died: edge3" in head and "did not finish" in head
    assert "service mm_edge1 has no NET_ADMIN" in head  # a note, beside the verdict


def test_moemesh_report_of_a_partial_folder_says_so(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tests.experiments.conftest import arm, make_rows, write_run
    from tests.helpers import moemesh

    t, r = make_rows("greedy", 25.0, seed=2)
    folder = write_run(tmp_path / "run", [arm("greedy"), arm("hetroute")], t, r,
                       error="RuntimeFailure: node edge2 did not start")
    assert moemesh("report", str(folder)) == 0
    err = capsys.readouterr().err
    assert "not a faithful run" in err and "the run did not finish (RuntimeFailure" in err
    assert "partial" in err
