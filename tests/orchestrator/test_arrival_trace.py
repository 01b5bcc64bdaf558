"""`arrival: trace`: real services' arrival traces (Azure, BurstGPT) read, checked and replayed
as the workload's requests (orchestrator.scenario.arrival_trace, experiments.run.workload)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from experiments.run.workload import plan_workload
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.arrival_trace import read_arrival_trace
from orchestrator.scenario.scenario import Workload, scenario_from_data, scenario_to_data
from orchestrator.scenario.yamlio import InputError, Loc

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "experiments" / "traces" / "azure-llm-conv-2023-first10min.csv"
SCENARIO = ROOT / "experiments" / "scenarios" / "trace-azure-lte.yaml"
TEXT = bytes(range(32, 127)) * 40  # prompts without the corpus: the plan's shape is the point


def test_the_shipped_azure_slice_reads_in_order_from_zero() -> None:
    trace = read_arrival_trace(AZURE)
    assert trace.layout == "azure" and len(trace.times_s) == 2867
    assert trace.times_s[0] == 0.0 and 599 < trace.span_s < 600
    assert all(a <= b for a, b in zip(trace.times_s, trace.times_s[1:], strict=False))
    assert (trace.prompt_tokens[0], trace.gen_tokens[0]) == (374, 44)  # the file's first row
    # the 7-digit fractions of a second are kept: 18:15:46.6805900 → 18:15:50.9951690
    assert trace.times_s[1] == pytest.approx(4.314579, abs=1e-6)


def test_a_burstgpt_trace_reads_by_its_header(tmp_path: Path) -> None:
    path = tmp_path / "burst.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "7.5,GPT-4,1087,260,1347,API log\n")
    trace = read_arrival_trace(path)
    assert trace.layout == "burstgpt"
    assert trace.times_s == (0.0, 2.5)
    assert trace.prompt_tokens == (472, 1087) and trace.gen_tokens == (18, 260)


@pytest.mark.parametrize(("content", "expected"), [
    ("when,prompt,output\n1,2,3\n", r"x\.csv:1: the header names no known layout"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n"
     "2023-11-16 18:15:47.1,SECRET-VALUE,2\n", r"x\.csv:3: ContextTokens: is missing"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\n"
     "2023-11-16 18:15:40.1,10,2\n", r"x\.csv:3: TIMESTAMP: goes back in time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,-4,2\n",
     r"x\.csv:2: token counts must be >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", r"x\.csv: no request rows"),
])
def test_a_bad_trace_names_file_line_and_column_never_its_content(
        tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "x.csv"
    path.write_text(content)
    with pytest.raises(InputError, match=expected) as info:
        read_arrival_trace(path)
    assert "SECRET" not in str(info.value)


def test_a_device_or_folder_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a regular file"):
        read_arrival_trace("/dev/zero")
    with pytest.raises(InputError, match="is a folder"):
        read_arrival_trace(tmp_path)


def test_the_workload_checks_what_belongs_to_a_trace() -> None:
    trace = read_arrival_trace(AZURE)
    with pytest.raises(ValueError, match="trace: missing"):
        Workload(arrival="trace", duration_s=10)
    with pytest.raises(ValueError, match="rate_rps: not for `arrival: trace`"):
        Workload(arrival="trace", trace=trace, rate_rps=2, duration_s=10)
    with pytest.raises(ValueError, match="speed: only for `arrival: trace`"):
        Workload(arrival="poisson", rate_rps=2, speed=2.0, duration_s=10)
    with pytest.raises(ValueError, match="trace_start_s: 700 s is not before the trace's last"):
        Workload(arrival="trace", trace=trace, trace_start_s=700, duration_s=10)
    with pytest.raises(ValueError, match="speed: must be > 0"):
        Workload(arrival="trace", trace=trace, speed=0, duration_s=10)


def test_the_plan_replays_the_trace_window_scaled_and_clipped() -> None:
    scenario = load_scenario(SCENARIO)
    w = scenario.workload
    plan = plan_workload(scenario, text=TEXT)
    trace = w.trace
    assert trace is not None
    window = [(t, p, g) for t, p, g in zip(trace.times_s, trace.prompt_tokens,
                                           trace.gen_tokens, strict=True)
              if w.trace_start_s <= t < w.trace_start_s + w.duration_s * w.speed]
    assert len(plan.requests) == len(window) > 20
    for req, (t, p, g) in zip(plan.requests, window, strict=True):
        assert req.at_s == pytest.approx((t - w.trace_start_s) / w.speed, abs=1e-6)
        assert len(req.prompt) == min(max(round(p * w.token_scale), 8), 48)
        assert req.gen_tokens == min(max(round(g * w.token_scale), 2), 16)
        assert req.warmup == (req.at_s < w.warmup_s)
    assert plan_workload(scenario, text=TEXT).requests == plan.requests  # seeded: the same
    homes = {r.home for r in plan.requests}
    assert homes <= set(scenario.topology.names) and len(homes) > 1
    shorter = replace(scenario, workload=replace(w, duration_s=None, requests=5))
    assert plan_workload(shorter, text=TEXT).requests == plan.requests[:5]
    assert shorter.workload.arrivals_end_s == pytest.approx(plan.requests[4].at_s)


def test_a_trace_scenario_round_trips_through_plain_data(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIO)
    back = scenario_from_data(scenario_to_data(scenario), Loc("x"), tmp_path)
    assert back.workload == scenario.workload
