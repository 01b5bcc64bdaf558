"""The fault timeline: what a scenario does to the mesh and when, and the runner that does it.

A `Fault` is one timeline entry (plain, frozen, validated data, read from a scenario's `faults:`
list or built by the `moemesh fault ...` commands). `FaultTimeline` applies a scenario's
timeline to a running mesh during an experiment and records, for every event, when it was due
and when it took effect, so results can draw the faults on the same time axis as the latencies.

Who does what: this module decides *when*; the target (`orchestrator.mesh.live.LiveMesh`) decides
*how*: link faults become a new link set on the nodes' `PUT /v1/links` (down = loss 100%,
a blackhole), node-down kills the node's process or container, node-up starts it again,
node-slow is `POST /v1/faults {"slow": FACTOR}`.

Times: `at_s` and `for_s` are scenario seconds from the workload's start. Under time dilation
TDF the wall clock runs TDF times slower, so an event due at `at_s` fires `at_s x TDF` wall
seconds after the start; records report scenario seconds (wall / TDF).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

from moe.vocab import check_one_of, clip, is_number
from netem import timing
from netem.parse import parse_delay_ms, parse_loss_pct, parse_rate_mbit
from netem.spec import LinkSpec
from orchestrator.runclock import REAL, RunClock
from orchestrator.scenario.units import parse_duration_s
from orchestrator.scenario.yamlio import Loc, Section, describe, locate

__all__ = [
    "FAULT_ACTIONS",
    "Fault",
    "FaultError",
    "FaultRecord",
    "FaultTarget",
    "FaultTimeline",
    "LinkChange",
    "fault_from_data",
    "fault_to_data",
    "read_faults",
]

FAULT_ACTIONS = {  # action -> node names it takes
    "link-down": 2, "link-up": 2, "link-degrade": 2,
    "node-down": 1, "node-up": 1, "node-slow": 1,
}
_UNDO = {"link-down": "link-up", "link-up": "link-down", "link-degrade": "link-up",
         "node-down": "node-up", "node-up": "node-down", "node-slow": "node-slow"}
# Dataclass field → the YAML key people write (errors name the YAML key).
ALIASES = {"at_s": "at", "for_s": "for", "change": ""}


def _finite(value: Any, name: str, *, ge: float | None = None, gt: float | None = None) -> None:
    if not is_number(value):
        raise ValueError(f"{name}: must be a finite number, got {describe(value)}")
    if ge is not None and value < ge:
        raise ValueError(f"{name}: must be >= {ge:g}, got {clip(value)}")
    if gt is not None and value <= gt:
        raise ValueError(f"{name}: must be > {gt:g}, got {clip(value)}")


def _floats(obj: object, *names: str) -> None:
    """Store validated numbers as floats, so 2 and 2.0 read back alike."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            object.__setattr__(obj, name, float(value))


@dataclass(frozen=True)
class LinkChange:
    """A link-degrade: the LinkSpec fields it replaces (None keeps the topology's value)."""

    delay_ms: float | None = None
    jitter_ms: float | None = None
    rate_mbit: float | None = None
    loss_pct: float | None = None

    def __post_init__(self) -> None:
        given = {f.name: getattr(self, f.name) for f in fields(self)
                 if getattr(self, f.name) is not None}
        if not given:
            raise ValueError("delay_ms: link-degrade needs at least one of delay_ms, "
                             "jitter_ms, rate_mbit, loss_pct")
        for name, value in given.items():
            _finite(value, name, ge=0)
            object.__setattr__(self, name, float(value))

    def apply(self, spec: LinkSpec) -> LinkSpec:
        """The degraded one-way spec (LinkSpec validates the result)."""
        return replace(spec, **{f.name: getattr(self, f.name) for f in fields(self)
                                if getattr(self, f.name) is not None})


@dataclass(frozen=True)
class Fault:
    """One timeline entry: at `at_s` (scenario seconds from the workload's start) do `action`.

    Link actions act on both directions A→B and B→A unless `oneway` (then A→B only).
    `link-up` restores the topology's spec (also after a degrade). With `for_s`, `undo()` gives
    the entry that reverts it `for_s` later.
    """

    at_s: float
    action: str
    target: tuple[str, ...]
    for_s: float | None = None
    change: LinkChange | None = None  # link-degrade only
    factor: float | None = None  # node-slow only: service times x factor
    oneway: bool = False

    def __post_init__(self) -> None:
        check_one_of("action", self.action, FAULT_ACTIONS)
        object.__setattr__(self, "target", tuple(self.target))
        arity = FAULT_ACTIONS[self.action]
        if len(self.target) != arity or not all(isinstance(t, str) for t in self.target):
            want = "two node names A B" if arity == 2 else "one node name"
            raise ValueError(f"{self.action}: needs {want}, got {clip(list(self.target))}")
        if arity == 2 and self.target[0] == self.target[1]:
            raise ValueError(f"{self.action}: a link joins two different nodes, "
                             f"got {clip(self.target[0])} twice")
        _finite(self.at_s, "at_s", ge=0)
        if self.for_s is not None:
            _finite(self.for_s, "for_s", gt=0)
        if (self.change is not None) != (self.action == "link-degrade"):
            raise ValueError(f"{self.action}: a LinkChange goes with link-degrade, and only "
                             f"with it")
        if self.factor is not None and self.action != "node-slow":
            raise ValueError(f"factor: only for node-slow, not {self.action}")
        if self.action == "node-slow":
            _finite(self.factor, "factor", gt=0)
        if self.oneway and arity != 2:
            raise ValueError(f"oneway: only for link actions, not {self.action}")
        _floats(self, "at_s", "for_s", "factor")

    @property
    def is_link(self) -> bool:
        return FAULT_ACTIONS[self.action] == 2

    def directions(self) -> tuple[tuple[str, str], ...]:
        """The one-way links a link action touches."""
        if not self.is_link:
            return ()
        a, b = self.target
        return ((a, b),) if self.oneway else ((a, b), (b, a))

    def undo(self) -> Fault | None:
        """The entry that reverts this one `for_s` later (None without `for_s`)."""
        if self.for_s is None:
            return None
        return Fault(self.at_s + self.for_s, _UNDO[self.action], self.target,
                     factor=1.0 if self.action == "node-slow" else None, oneway=self.oneway)

    def describe(self) -> str:
        text = f"{self.action} {' '.join(self.target)}"
        if self.change is not None:
            text += " " + " ".join(f"{f.name}={getattr(self.change, f.name):g}"
                                   for f in fields(self.change)
                                   if getattr(self.change, f.name) is not None)
        if self.factor is not None:
            text += f" x{self.factor:g}"
        if self.is_link:
            text += " (one-way)" if self.oneway else " (both ways)"
        if self.for_s is not None:
            text += f" for {self.for_s:g} s"
        return text


def _names(raw: Any, loc: Loc) -> list[Any]:
    """Positional fault arguments: "edge1 edge2" or [edge1, edge2]."""
    if isinstance(raw, str):
        return raw.split()
    if isinstance(raw, list):
        return list(raw)
    raise loc.error(f"must be node names like 'edge1 edge2', got {describe(raw)}")


_CHANGE_PARSERS = {"delay_ms": parse_delay_ms, "jitter_ms": parse_delay_ms,
                   "rate_mbit": parse_rate_mbit, "loss_pct": parse_loss_pct}


def read_faults(raw: Any, loc: Loc) -> tuple[Fault, ...]:
    """A scenario's `faults:` list."""
    if not isinstance(raw, list):
        raise loc.error(f"must be a list of faults, got {describe(raw)}")
    return tuple(fault_from_data(item, loc.item(raw, i)) for i, item in enumerate(raw))


def fault_from_data(data: Any, loc: Loc) -> Fault:
    """One entry like `{at: 30s, link-down: edge1 edge2, for: 10s}` (also what the
    `moemesh fault` commands build); errors carry file, line and field."""
    sec = Section(data, loc, "a fault mapping like {at: 30s, link-down: edge1 edge2}")
    actions = [k for k in FAULT_ACTIONS if k in sec]
    if len(actions) != 1:
        raise loc.error(f"needs exactly one action ({', '.join(FAULT_ACTIONS)}), "
                        f"got {', '.join(actions) or 'none'}")
    action = actions[0]
    args = sec.value(action, _names)
    at_s = sec.unit("at", parse_duration_s)
    for_s = sec.unit("for", parse_duration_s, None)
    oneway = sec.boolean("oneway", False)
    values = {k: sec.unit(k, parse) for k, parse in _CHANGE_PARSERS.items() if k in sec}
    change = None
    if action == "link-degrade":
        try:
            change = LinkChange(**values)
        except ValueError as exc:
            raise locate(exc, data, loc, None if values else {"delay_ms": action}) from None
    elif values:
        raise sec.at(next(iter(values))).error(f"only for link-degrade, not {action}")
    factor = sec.raw("factor", None)
    if action == "node-slow" and len(args) == 2:
        if factor is not None:
            raise sec.at("factor").error("given twice: as `node-slow: N FACTOR` and `factor`")
        text = args.pop()
        try:
            factor = float(text)
        except (TypeError, ValueError):
            raise sec.at(action).error(f"factor must be a number, got {clip(text)}") from None
    if action == "node-slow" and factor is None:
        raise sec.at(action).error("needs a factor: `node-slow: edge2 3` or `factor: 3`")
    sec.done()
    try:
        return Fault(at_s, action, tuple(args), for_s=for_s, change=change, factor=factor,
                     oneway=oneway)
    except ValueError as exc:
        raise locate(exc, data, loc, ALIASES) from None


def fault_to_data(fault: Fault) -> dict[str, Any]:
    """The YAML form that `fault_from_data` reads back to an equal Fault."""
    out: dict[str, Any] = {"at": fault.at_s, fault.action: " ".join(fault.target)}
    if fault.change is not None:
        out.update({f.name: getattr(fault.change, f.name) for f in fields(fault.change)
                    if getattr(fault.change, f.name) is not None})
    if fault.factor is not None:
        out["factor"] = fault.factor
    if fault.oneway:
        out["oneway"] = True
    if fault.for_s is not None:
        out["for"] = fault.for_s
    return out


# ----------------------------------------------------------------------------- the runner


class FaultTarget(Protocol):
    """What a timeline acts on: a running mesh (`orchestrator.mesh.live.LiveMesh`)."""

    async def apply_fault(self, fault: Fault) -> Mapping[str, Any]:
        """Make the fault true on the mesh; return what was done (JSON-ready)."""
        ...


@dataclass(frozen=True)
class FaultRecord:
    """One event of the timeline. Times are scenario seconds from the timeline's start: `at_s`
    when it was due, `started_s` when applying began, `done_s` when every call had returned;
    all three but `at_s` None for an event the workload ended before (`not_applied`)."""

    at_s: float
    started_s: float | None
    done_s: float | None
    wall_time: float | None  # time.time() at done_s, to line up with other logs
    action: str
    target: tuple[str, ...]
    description: str
    ok: bool
    error: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)
    applied: bool = True

    @classmethod
    def not_applied(cls, event: Fault, end_s: float) -> FaultRecord:
        """An event the workload ended before (a closed loop's end is known only when it
        comes): kept, so that a fault the scenario states never vanishes from the report."""
        return cls(event.at_s, None, None, None, event.action, event.target, event.describe(),
                   ok=False, applied=False,
                   error=f"not applied: the workload ended first, at {end_s:.2f} s")

    def to_json(self) -> dict[str, Any]:
        def at(t: float | None) -> float | None:
            return None if t is None else round(t, 6)

        out = {"at_s": self.at_s, "started_s": at(self.started_s), "done_s": at(self.done_s),
               "wall_time": self.wall_time, "action": self.action, "target": list(self.target),
               "description": self.description, "ok": self.ok, "error": self.error,
               "detail": dict(self.detail)}
        return out if self.applied else {**out, "applied": False}


class FaultError(RuntimeError):
    """An event of the timeline could not be applied; `record` says which and why."""

    def __init__(self, record: FaultRecord) -> None:
        super().__init__(f"fault at {record.at_s:g} s ({record.description}) failed: "
                         f"{record.error}")
        self.record = record


class FaultTimeline:
    """Applies events at their times against a target and records each one.

    `run()` returns when the last event has been applied; cancel it to stop early (the
    records so far stay in `records`). An event that fails is recorded, then `FaultError` is
    raised: an experiment whose faults did not happen must not report as if they had.
    `run_clock` turns the events' scenario times into wall times (the run's dilation);
    `clock` (seconds, monotonic) and `sleep` may be replaced by a virtual clock in tests.
    """

    def __init__(
        self,
        target: FaultTarget,
        events: Sequence[Fault],
        *,
        run_clock: RunClock = REAL,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
    ) -> None:
        for event in events:
            if not isinstance(event, Fault):
                raise ValueError(f"timeline events must be Fault, got {clip(event)}")
        self.target = target
        self.events = tuple(sorted(events, key=lambda f: f.at_s))
        self.run_clock = run_clock
        self._clock = clock or timing.now
        self._sleep = sleep or timing.sleep_for
        self.records: list[FaultRecord] = []
        # nodes a node-down has taken and no node-up given back: down from the moment the
        # kill begins, up once the restart is done (what users may be sent to)
        self.down: set[str] = set()

    async def run(self) -> list[FaultRecord]:
        start = self._clock()
        rc = self.run_clock
        for event in self.events:
            due = start + rc.to_wall_s(event.at_s)
            while (left := due - self._clock()) > 0:
                await self._sleep(left)
            began = self._clock()
            if event.action == "node-down":
                self.down.update(event.target)
            try:
                detail = await self.target.apply_fault(event)
                error = ""
                if event.action == "node-up":
                    self.down.difference_update(event.target)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # recorded, then raised as FaultError below
                detail, error = {}, f"{type(exc).__name__}: {exc}"
            done = self._clock()
            record = FaultRecord(
                at_s=event.at_s, started_s=rc.since(start, began), done_s=rc.since(start, done),
                wall_time=time.time(), action=event.action, target=event.target,
                description=event.describe(), ok=not error, error=error, detail=dict(detail))
            self.records.append(record)
            if error:
                raise FaultError(record)
        return list(self.records)
