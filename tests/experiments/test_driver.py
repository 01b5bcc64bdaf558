"""Answers of /v1/generate → rows, and requests that never got an answer."""

from __future__ import annotations

import math

import pytest

from experiments.run.driver import Driver, rows_of_answer
from experiments.run.runner import RunOptions, shorten
from experiments.run.workload import Request, plan_workload
from orchestrator.mesh.faults import Fault
from orchestrator.runclock import RunClock
from orchestrator.scenario.arms import Arm
from tests.experiments.conftest import TEXT, small_scenario
from tests.helpers import free_port

ARM = Arm("hetroute", "hetroute")
REQ = Request(7, "edge1", (1, 2, 3), 5, 0.5, False, None, 11)


def _record(i: int, status: str = "ok", reason: str | None = None) -> dict:
    return {"index": i, "status": status, "reason": reason, "latency_ms": 40.0, "quality": 0.001,
            "retries": 0, "reroutes": 1 if i == 1 else 0, "bytes": 2048,
            "mix": {"local_exact": 3, "remote_exact": 1, "cpu_loaded": 0, "substitute": 0,
                    "fallback": 0},
            "quantized": 1, "layers": [{"predicted_ms": 5.0}, {"predicted_ms": 7.0}],
            "choices": [[0, 1, 1, "edge1", "fp16", "exact", True, False],
                        [0, 2, 2, "edge2", "int8", "quantized", False, False]]}


def test_a_generation_that_stops_accounts_for_every_token() -> None:
    answer = {"records": [_record(0), _record(1), _record(2, "failed", "no_replica")],
              "failed": "no_replica", "ttft_ms": 80.0}
    tokens, req = rows_of_answer(ARM, REQ, 0.5, 0.6, 1.0, RunClock(2.0), answer)
    assert [t.status for t in tokens] == ["ok", "ok", "failed", "failed", "failed"]
    assert [t.reason for t in tokens] == ["", "", "no_replica", "after:no_replica",
                                          "after:no_replica"]
    assert tokens[0].latency_ms == 20.0  # 40 ms wall / time dilation 2
    assert tokens[1].done_s == pytest.approx(0.6 + 0.04)
    assert tokens[0].predicted_ms == 6.0 and tokens[0].local == 1 and tokens[1].reroutes == 1
    assert (req.completed, req.failed, req.ttft_ms) == (2, 3, 40.0)
    assert req.latency_ms == pytest.approx(400.0)


def test_a_token_no_replica_could_serve_names_the_expert_in_its_row() -> None:
    failed = {**_record(1, "failed", "no_replica_reachable"),
              "failure": {"layer": 2, "expert": 5, "tried": ["edge2", "edge4"],
                          "cut_off": ["edge3"], "why": "deadline"}}
    answer = {"records": [_record(0), failed], "failed": "no_replica_reachable"}
    tokens, _ = rows_of_answer(ARM, REQ, 0.5, 0.6, 1.0, RunClock(), answer)
    assert tokens[0].failure == ""
    assert tokens[1].reason == "no_replica_reachable"
    assert tokens[1].failure == ("layer 2 expert 5: deadline; tried edge2, edge4; "
                                 "cut off edge3")


def test_a_lost_request_fails_all_its_tokens_with_its_reason() -> None:
    tokens, req = rows_of_answer(ARM, REQ, 0.5, 0.6, 0.9, RunClock(), None, "unreachable:X")
    assert len(tokens) == 5 and {t.reason for t in tokens} == {"request:unreachable:X"}
    assert math.isnan(req.ttft_ms) and req.failed == 5 and req.error == "unreachable:X"


async def test_an_unreachable_home_node_is_a_failed_request_not_a_crash() -> None:
    port = free_port()  # a port nothing listens on
    plan = plan_workload(small_scenario(duration_s=None, requests=3, warmup_s=0.0), TEXT)
    urls = {n: f"http://127.0.0.1:{port}" for n in ("edge1", "edge2", "edge3")}
    result = await Driver(plan, ARM, urls, run_clock=RunClock(1.0)).run()
    assert len(result.requests) == 3
    assert all(r.error.startswith("unreachable") for r in result.requests)
    assert len(result.tokens) == sum(r.gen_tokens for r in plan.requests)
    with pytest.raises(ValueError, match="no URL for home node"):
        Driver(plan, ARM, {"edge3": "http://x"})


def test_shorten_keeps_faults_that_still_happen() -> None:
    sc = small_scenario()
    from dataclasses import replace

    sc = replace(sc, faults=(Fault(3.0, "link-down", ("edge1", "edge2"), for_s=2.0),
                             Fault(15.0, "node-down", ("edge3",))))
    short, notes = shorten(sc, duration_s=10.0)
    assert short.workload.duration_s == 10.0 and len(short.faults) == 1
    assert any("dropped" in n for n in notes)
    counted, _ = shorten(sc, requests=6)
    assert counted.workload.requests == 6 and counted.workload.duration_s is None
    with pytest.raises(ValueError, match="not both"):
        shorten(sc, requests=3, duration_s=4.0)
    with pytest.raises(ValueError, match="overhead_requests"):
        RunOptions(overhead_requests=-1)


async def test_a_closed_loop_sends_exactly_its_request_count() -> None:
    port = free_port()
    sc = small_scenario(arrival="closed", rate_rps=None, concurrency=2, duration_s=None,
                        requests=5, warmup_s=0.0)
    plan = plan_workload(sc, TEXT)
    urls = {n: f"http://127.0.0.1:{port}" for n in ("edge1", "edge2", "edge3")}
    result = await Driver(plan, ARM, urls).run()
    ids = [r.request for r in result.requests]
    assert len(ids) == len(set(ids)) == 5
    # a request's id is k x users + user: the same id, the same prompt, under every policy
    assert all(r.request % 2 == r.user for r in result.requests)
    assert {r.user for r in result.requests} <= {0, 1}
    assert all(r.at_s == r.sent_s or abs(r.at_s - r.sent_s) < 0.05 for r in result.requests)


async def _serve(handler) -> tuple[str, object]:
    """A real aiohttp server on a free port that answers /v1/generate with `handler`."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


async def test_a_500_from_generate_fails_the_run_with_the_nodes_message() -> None:
    from aiohttp import web

    from experiments.run.driver import RequestRefused

    async def crash(request: web.Request) -> web.Response:
        return web.json_response({"error": "internal", "detail": "KeyError: 'edge9'"},
                                 status=500)

    url, runner = await _serve(crash)
    try:
        plan = plan_workload(small_scenario(duration_s=None, requests=2, warmup_s=0.0), TEXT)
        urls = dict.fromkeys(("edge1", "edge2", "edge3"), url)
        with pytest.raises(RequestRefused, match=r"500 \(a bug, not a fault\).*KeyError"):
            await Driver(plan, ARM, urls).run()
    finally:
        await runner.cleanup()


async def test_a_503_is_a_fault_and_connections_are_bounded() -> None:
    """A 503 (overloaded) fails the request's tokens as `request:http_503`; with
    `connections=2`, never more than two requests are in flight at once."""
    import asyncio

    from aiohttp import web

    from experiments.run.driver import DriveLimits

    inflight, most = 0, 0

    async def busy(request: web.Request) -> web.Response:
        nonlocal inflight, most
        inflight += 1
        most = max(most, inflight)
        await asyncio.sleep(0.2)
        inflight -= 1
        return web.json_response({"error": "overloaded", "detail": "queue full"}, status=503)

    url, runner = await _serve(busy)
    try:
        sc = small_scenario(duration_s=None, requests=6, warmup_s=0.0, rate_rps=1000.0)
        plan = plan_workload(sc, TEXT)
        urls = dict.fromkeys(("edge1", "edge2", "edge3"), url)
        result = await Driver(plan, ARM, urls, limits=DriveLimits(connections=2)).run()
    finally:
        await runner.cleanup()
    assert {r.error for r in result.requests} == {"http_503"}
    assert {t.reason for t in result.tokens} == {"request:http_503"}
    assert most == 2


async def test_a_request_whose_home_is_down_is_served_by_the_node_rehome_names() -> None:
    """Every home but edge2 listens on a dead port; `rehome` sends their users to edge2, whose
    server answers (503 here, enough to see who was asked): no request is unreachable, and each
    row names the serving node and the user's own home."""
    from aiohttp import web

    asked = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response({"error": "overloaded", "detail": "test"}, status=503)

    url, runner = await _serve(answer)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        plan = plan_workload(small_scenario(duration_s=None, requests=6, warmup_s=0.0), TEXT)
        urls = {"edge1": dead, "edge2": url, "edge3": dead}
        result = await Driver(plan, ARM, urls,
                              rehome=lambda h: "edge2" if h != "edge2" else h).run()
    finally:
        await runner.cleanup()
    assert asked == len(plan.requests) == len(result.requests)
    assert {r.error for r in result.requests} == {"http_503"}
    own = {r.id: r.home for r in plan.requests}
    for row in result.requests:
        assert row.home == "edge2"
        assert row.rehomed_from == ("" if own[row.request] == "edge2" else own[row.request])
    assert any(r.rehomed_from for r in result.requests)
    assert {t.home for t in result.tokens} == {"edge2"}


def test_the_nearest_live_node_is_the_shortest_round_trip_ties_by_name() -> None:
    from orchestrator.scenario.topology import topology_from_data
    from orchestrator.scenario.yamlio import Loc

    topo = topology_from_data({
        "nodes": [{"name": n, "gpu_tflops": 1, "gpu_mem_gb": 1, "cpu_mem_gb": 1,
                   "h2d_gbps": 1} for n in ("a", "b", "c", "d")],
        "defaults": {"delay_ms": 10, "rate_mbit": 100},
        "links": [{"between": ["a", "c"], "delay_ms": 2},
                  {"between": ["a", "d"], "delay_ms": 2}]}, Loc("test"))
    assert topo.nearest("a", set()) == "a"
    assert topo.nearest("a", {"a"}) == "c"
    assert topo.nearest("a", {"a", "c"}) == "d"
    assert topo.nearest("a", {"a", "c", "d"}) == "b"
    assert topo.nearest("a", {"a", "b", "c", "d"}) == "a"


async def test_a_fault_the_workload_ended_before_is_recorded_as_not_applied() -> None:
    # a closed loop's end is known only when it comes, so shorten() cannot drop its late faults
    from dataclasses import replace
    from types import SimpleNamespace

    from experiments.run.progress import RunProgress
    from experiments.run.runner import _drive_with_faults

    port = free_port()  # nothing listens: the three requests fail at once
    sc = small_scenario(arrival="closed", rate_rps=None, concurrency=1, duration_s=None,
                        requests=3, warmup_s=0.0)
    sc = replace(sc, faults=(Fault(500.0, "node-down", ("edge3",)),))
    urls = {n: f"http://127.0.0.1:{port}" for n in ("edge1", "edge2", "edge3")}
    mesh = SimpleNamespace(urls=urls)  # the fault is never due: nothing calls the mesh
    with RunProgress("t", quiet=True) as progress:
        progress.arm(ARM.label, 3)
        result, faults = await _drive_with_faults(mesh, sc, plan_workload(sc, TEXT), ARM,
                                                  RunOptions(), progress)
    assert len(result.requests) == 3
    (rec,) = faults
    assert rec["applied"] is False and rec["ok"] is False and rec["done_s"] is None
    assert rec["at_s"] == 500.0 and rec["error"].startswith("not applied: the workload ended")
