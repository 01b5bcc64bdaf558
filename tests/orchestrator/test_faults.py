"""The fault timeline: when events fire and what is recorded (virtual clock), and what they do
to a live mesh of real node processes (each effect checked on the nodes themselves)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from netem.spec import LinkSpec
from orchestrator.mesh import faults as faults_mod
from orchestrator.mesh.faults import (
    Fault,
    FaultError,
    FaultTimeline,
    LinkChange,
    fault_from_data,
    fault_to_data,
)
from orchestrator.mesh.live import LiveMesh
from orchestrator.placement import place, problem_from_scenario
from orchestrator.runclock import RunClock
from orchestrator.runtimes.local import LocalRuntime, process_alive
from orchestrator.scenario import scenario as scenario_mod
from orchestrator.scenario.arms import load_scenario
from orchestrator.scenario.yamlio import InputError, Loc
from services.client import ClientSettings, NodeClient
from services.wire import Group, Work
from tests.helpers import TOKEN, wait_until


class VirtualClock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class Recorder:
    """Stands in for the mesh in the scheduling tests only (the live mesh is tested below):
    it notes when each event reached it and can take time or fail."""

    def __init__(self, clock: VirtualClock, takes_s: float = 0.0, fail: str = "") -> None:
        self.clock, self.takes_s, self.fail = clock, takes_s, fail
        self.seen: list[tuple[float, str]] = []

    async def apply_fault(self, fault: Fault) -> Mapping[str, Any]:
        self.seen.append((self.clock(), fault.describe()))
        self.clock.now += self.takes_s
        if fault.action == self.fail:
            raise RuntimeError(f"{fault.action} went wrong")
        return {"did": fault.action}


async def test_events_fire_at_their_dilated_times_and_are_recorded() -> None:
    clock = VirtualClock()
    target = Recorder(clock, takes_s=0.4)
    events = [Fault(5.0, "node-down", ("b",)), Fault(1.0, "link-down", ("a", "b"), for_s=2.0)]
    events.append(events[1].undo())
    timeline = FaultTimeline(target, events, run_clock=RunClock(4.0), clock=clock,
                             sleep=clock.sleep)
    records = await timeline.run()
    # wall times: at_s x 4 after the start (100.0)
    assert [t for t, _ in target.seen] == [104.0, 112.0, 120.0]
    assert [r.action for r in records] == ["link-down", "link-up", "node-down"]
    assert [r.at_s for r in records] == [1.0, 3.0, 5.0]
    assert [r.started_s for r in records] == pytest.approx([1.0, 3.0, 5.0])
    assert [r.done_s for r in records] == pytest.approx([1.1, 3.1, 5.1])  # 0.4 wall / 4
    assert all(r.ok and r.detail == {"did": r.action} for r in records)
    assert records[0].to_json()["description"] == "link-down a b (both ways) for 2 s"


async def test_a_node_is_down_from_its_kill_until_its_restart_is_done() -> None:
    """`down` (where the driver must not send users) holds a killed node while the kill is
    still under way, and gives it back only once the node-up has been applied."""
    clock = VirtualClock()
    seen: list[tuple[str, frozenset[str]]] = []

    class Watching(Recorder):
        async def apply_fault(self, fault: Fault) -> Mapping[str, Any]:
            seen.append((fault.action, frozenset(timeline.down)))
            return await super().apply_fault(fault)

    kill = Fault(1.0, "node-down", ("b",), for_s=2.0)
    timeline = FaultTimeline(Watching(clock), [kill, kill.undo(), Fault(4.0, "node-down", ("c",))],
                             clock=clock, sleep=clock.sleep)
    await timeline.run()
    assert seen == [("node-down", {"b"}), ("node-up", {"b"}), ("node-down", {"c"})]
    assert timeline.down == {"c"}


async def test_a_failed_event_is_recorded_then_raised() -> None:
    clock = VirtualClock()
    target = Recorder(clock, fail="node-slow")
    events = [Fault(1.0, "link-down", ("a", "b")), Fault(2.0, "node-slow", ("a",), factor=2.0),
              Fault(3.0, "node-down", ("a",))]
    timeline = FaultTimeline(target, events, clock=clock, sleep=clock.sleep)
    with pytest.raises(FaultError, match=r"fault at 2 s \(node-slow a x2\) failed: "
                                         r"RuntimeError: node-slow went wrong"):
        await timeline.run()
    assert [r.ok for r in timeline.records] == [True, False]
    assert len(target.seen) == 2  # the event after the failure never ran


async def test_cancelling_keeps_the_records_so_far() -> None:
    target = Recorder(VirtualClock())
    timeline = FaultTimeline(target, [Fault(0.0, "link-down", ("a", "b")),
                                      Fault(30.0, "link-up", ("a", "b"))])
    task = asyncio.ensure_future(timeline.run())
    await wait_until(lambda: len(timeline.records) == 1, "the first fault's record")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [r.action for r in timeline.records] == ["link-down"]


def test_timeline_input_is_checked() -> None:
    with pytest.raises(ValueError, match="time_dilation: must be > 0, got 0"):
        FaultTimeline(Recorder(VirtualClock()), [], run_clock=RunClock(0))
    with pytest.raises(ValueError, match="timeline events must be Fault"):
        FaultTimeline(Recorder(VirtualClock()), [{"at": 1}])  # type: ignore[list-item]


def test_fault_data_moved_here_and_still_reads_back() -> None:
    assert scenario_mod.Fault is faults_mod.Fault and scenario_mod.LinkChange is LinkChange
    data = {"at": "2s", "link-degrade": "a b", "delay_ms": "40ms", "rate_mbit": "10mbit",
            "for": "500ms", "oneway": True}
    fault = fault_from_data(data, Loc("cli", "fault"))
    assert fault == Fault(2.0, "link-degrade", ("a", "b"), for_s=0.5,
                          change=LinkChange(delay_ms=40.0, rate_mbit=10.0), oneway=True)
    assert fault_from_data(fault_to_data(fault), Loc()) == fault
    assert fault.change.apply(LinkSpec(delay_ms=1, rate_mbit=100)) == LinkSpec(
        delay_ms=40, rate_mbit=10)
    with pytest.raises(InputError, match=r"^cli: fault.node-slow: needs a factor"):
        fault_from_data({"at": 0, "node-slow": "a"}, Loc("cli", "fault"))


# ----------------------------------------------------------------------------- a live mesh

SCENARIO = """\
name: faults
topology:
  nodes:
    - {name: a, profile: tiny-edge}
    - {name: b, profile: tiny-edge}
    - {name: c, profile: tiny-edge}
  defaults: {delay_ms: 1ms, rate_mbit: 1gbit}
model: tiny-moe
runtime: local
shaper: app
workload: {rate_rps: 1, requests: 1}
"""


@pytest.mark.slow
async def test_faults_on_a_live_local_mesh(tmp_path: Path) -> None:
    path = tmp_path / "faults.yaml"
    path.write_text(SCENARIO)
    scenario = load_scenario(path)
    result = place(problem_from_scenario(scenario, tokens=64), "hetroute")
    async with NodeClient(ClientSettings(token=TOKEN, name="b", control_s=30)) as client:
        async with LiveMesh(scenario, LocalRuntime(), result, token=TOKEN) as mesh:
            urls = mesh.urls
            assert mesh.runtime == "local" and mesh.shaper == "app"
            stats = await client.stats(urls["a"])
            assert len(stats["placement"]) == len(result.by_node()["a"])
            assert stats["links"]["applied"]["links"]["b"]["loss_pct"] == 0.0

            timeline = FaultTimeline(mesh, [
                Fault(0.05, "link-degrade", ("a", "b"), change=LinkChange(delay_ms=250.0),
                      oneway=True),
                Fault(0.1, "link-down", ("a", "c")),
                Fault(0.15, "node-slow", ("b",), factor=3.0),
                Fault(0.2, "node-down", ("c",)),
            ])
            started = time.monotonic()
            records = await timeline.run()
            assert all(r.ok for r in records) and time.monotonic() - started >= 0.2
            a_links = (await client.stats(urls["a"]))["links"]["applied"]["links"]
            assert a_links["b"]["delay_ms"] == 250.0 and a_links["c"]["loss_pct"] == 100.0
            b_stats = await client.stats(urls["b"])
            assert b_stats["links"]["applied"]["links"]["a"]["delay_ms"] == 1.0  # one-way
            assert b_stats["faults"]["slow"] == 3.0

            # the degraded link reaches the data plane: a's answer to "b" waits 250 ms
            held = result.by_node()["a"][0]
            item = Group(held["layer"], "f32", bytes(4 * stats["d_model"]),
                         ((Work(held["expert"], held["variant"], 1.0),),))
            t0 = time.monotonic()
            await client.forward(urls["a"], [item])
            assert time.monotonic() - t0 >= 0.25

            assert "c" not in mesh.launcher.processes()  # c's process is gone
            status = await mesh.status()
            assert status["nodes"]["c"]["state"] == "down"
            assert {(lk["from"], lk["to"]): lk["state"] for lk in status["links"]} == {
                ("a", "b"): "degraded", ("a", "c"): "down", ("c", "a"): "down"}

            await mesh.apply_fault(Fault(0.0, "node-up", ("c",)))
            c_stats = await client.stats(urls["c"])
            assert len(c_stats["placement"]) == len(result.by_node()["c"])
            assert c_stats["links"]["applied"]["links"]["a"]["loss_pct"] == 100.0  # still cut
            procs = mesh.launcher.processes()

            await mesh.reset()
            assert (await mesh.status())["links"] == []
            # the mesh's own faults and resets are its own; a link set put by someone else
            # (moemesh fault --project by hand) is told apart
            assert await mesh.links_set_elsewhere() == []
            accepted = (await client.stats(urls["b"]))["links"]["accepted"]
            await client.put_links(urls["b"], accepted["links"], accepted["backend"])
            assert await mesh.links_set_elsewhere() == ["b"]
            await mesh.reset()
            assert await mesh.links_set_elsewhere() == []
            assert (await client.stats(urls["b"]))["faults"]["slow"] == 1.0
            a_links = (await client.stats(urls["a"]))["links"]["applied"]["links"]
            assert a_links["b"]["delay_ms"] == 1.0 and a_links["c"]["loss_pct"] == 0.0

            with pytest.raises(ValueError, match="unknown node 'z'"):
                await mesh.apply_fault(Fault(0.0, "node-down", ("z",)))
            with pytest.raises(ValueError, match="factor must be >= 1"):
                await mesh.apply_fault(Fault(0.0, "node-slow", ("a",), factor=0.5))
        assert not any(process_alive(p, t) for p, t in procs.values())
