"""Time-varying links: a schedule of steps, read from a CSV or a Mahimahi trace.

A `Schedule` is a list of steps `(t_s, delay_ms, rate_mbit, loss_pct)`; from t_s on (seconds
since the link was applied) the link has those values, a None value keeping the link's own. The
steps may loop with period `loop_s` (else the last step holds). Both backends follow the same
schedule: tc changes the existing class and netem leaf in place at each step (`change`, never
delete-and-add, so packets already queued keep the delay they were given), the app backend reads
the step in force when it schedules a send (and integrates the serialiser across steps).

Sources (`read_csv`, `read_mahimahi`), each error naming the file and line:
- CSV: `t_s,delay_ms,rate_mbit,loss_pct` per line (a header line of those names and `#`
  comments allowed; an empty cell keeps the link's own value); the first step at t_s = 0.
- Mahimahi delivery-opportunity trace: one millisecond timestamp per line, each a chance to
  deliver 1,504 bytes; the trace loops with period = its last timestamp (`netem.mahimahi`). The
  schedule keeps the trace itself (`Schedule.trace`), which the app backend delivers by,
  opportunity by opportunity, as Mahimahi does; and rate steps of `bin_ms` (default 100 ms) for
  tc, which cannot: rate = opportunities x 12,032 bit / bin. A bin with no opportunity gets
  MIN_RATE_MBIT (HTB cannot run at 0), which the schedule records.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from moe.vocab import clip
from netem.mahimahi import PACKET_BYTES, DeliveryTrace, parse_trace

__all__ = ["MIN_RATE_MBIT", "Schedule", "Step", "read_csv", "read_lines", "read_mahimahi",
           "read_schedule"]

MIN_RATE_MBIT = 0.012  # about one 1,500-byte packet per second
DEFAULT_BIN_MS = 100.0
MAX_STEPS = 100_000
MAX_FILE_BYTES = 16 << 20  # a schedule or trace file (the shipped traces are under 90 kB)
CSV_COLUMNS = ("t_s", "delay_ms", "rate_mbit", "loss_pct")


class Step(NamedTuple):
    t_s: float
    delay_ms: float | None = None
    rate_mbit: float | None = None
    loss_pct: float | None = None


# times within this of a step count as at it: far below a packet's time, far above the rounding
# of a loop's period times a step's time (seconds)
_SNAP_S = 1e-9


@dataclass(frozen=True)
class Schedule:
    """Steps from t = 0 (seconds since applied), optionally looping every loop_s; `trace`: the
    Mahimahi trace the steps were binned from (its period is loop_s), for the app backend."""

    steps: tuple[Step, ...]
    loop_s: float | None = None
    source: str = ""
    trace: DeliveryTrace | None = None
    _times: tuple[float, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        steps = tuple(Step(*s) for s in self.steps)
        if not steps:
            raise ValueError("schedule: no steps")
        if len(steps) > MAX_STEPS:
            raise ValueError(f"schedule: {len(steps)} steps, at most {MAX_STEPS}")
        if steps[0].t_s != 0:
            raise ValueError(f"schedule: the first step must be at t_s = 0, got {steps[0].t_s}")
        for i, (before, after) in enumerate(itertools.pairwise(steps), start=1):
            if not after.t_s > before.t_s:
                raise ValueError(f"schedule: step {i} (t_s={after.t_s:g}) is not after step "
                                 f"{i - 1} (t_s={before.t_s:g})")
        for i, step in enumerate(steps):
            for name, value in zip(CSV_COLUMNS, step, strict=True):
                if value is not None and (isinstance(value, bool) or not isinstance(
                        value, int | float) or not math.isfinite(value)):
                    raise ValueError(f"schedule: step {i} {name} must be a number, "
                                     f"got {clip(value)}")
        if self.loop_s is not None and not self.loop_s > steps[-1].t_s:
            raise ValueError(f"schedule: loop_s ({self.loop_s:g}) must be after the last step "
                             f"(t_s={steps[-1].t_s:g})")
        if self.trace is not None:
            if not isinstance(self.trace, DeliveryTrace):
                raise ValueError(f"schedule: trace must be a DeliveryTrace, got {clip(self.trace)}")
            if self.loop_s is None or not math.isclose(self.loop_s * 1e3, self.trace.period_ms):
                raise ValueError(f"schedule: loop_s ({self.loop_s}) must be the trace's period "
                                 f"({self.trace.period_ms / 1e3:g} s)")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "_times", tuple(s.t_s for s in steps))

    def index_at(self, t_s: float) -> int:
        """The step in force t_s seconds after the link was applied."""
        _, phase = self._locate(t_s)
        return max(0, bisect.bisect_right(self._times, phase + _SNAP_S) - 1)

    def next_change(self, t_s: float) -> float | None:
        """The time (> t_s, seconds since applied) of the next step after t_s; None: never.
        `index_at` of the time returned gives the new step (both locate t_s alike)."""
        base, phase = self._locate(t_s)
        i = bisect.bisect_right(self._times, phase + _SNAP_S)
        if i < len(self._times):
            return base + self._times[i]
        return None if self.loop_s is None else base + self.loop_s

    def _locate(self, t_s: float) -> tuple[float, float]:
        """(start of the loop period holding t_s, t_s's offset in it); (0, t_s) without a loop.
        One rule for both lookups: a time that `next_change` computed as base + step time
        may round a hair below that step, which `_SNAP_S` absorbs."""
        if self.loop_s is None:
            return 0.0, t_s
        k = math.floor((t_s + _SNAP_S) / self.loop_s)
        base = k * self.loop_s
        return base, max(0.0, t_s - base)

    def scaled(self, factor: float) -> Schedule:
        """In emulated time (time dilation): times and delays x factor, rates / factor."""
        def mul(v: float | None) -> float | None:
            return None if v is None else v * factor

        steps = tuple(Step(s.t_s * factor, mul(s.delay_ms),
                           None if s.rate_mbit is None else s.rate_mbit / factor, s.loss_pct)
                      for s in self.steps)
        return Schedule(steps, mul(self.loop_s), self.source,
                        None if self.trace is None else self.trace.scaled(factor))

    def to_json(self) -> dict[str, Any]:
        out = {"steps": [list(s) for s in self.steps], "loop_s": self.loop_s,
               "source": self.source}
        if self.trace is not None:
            out["trace"] = self.trace.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> Schedule:
        if not isinstance(data, Mapping) or "steps" not in data:
            raise ValueError(f"schedule must be a mapping with steps, got {clip(data)}")
        unknown = sorted(set(data) - {"steps", "loop_s", "source", "trace"})
        if unknown:
            raise ValueError(f"schedule: unknown field(s) {', '.join(unknown)}; "
                             "known: steps, loop_s, source, trace")
        raw = data["steps"]
        if not isinstance(raw, list) or not all(
                isinstance(s, list | tuple) and 1 <= len(s) <= 4 for s in raw):
            raise ValueError("schedule.steps must be a list of [t_s, delay_ms, rate_mbit, "
                             "loss_pct] lists (null keeps the link's value)")
        trace = data.get("trace")
        return cls(tuple(Step(*s) for s in raw), data.get("loop_s"), str(data.get("source", "")),
                   None if trace is None else DeliveryTrace.from_json(trace))


def _number(text: str, what: str) -> float | None:
    """A cell's number; the error names the place, never the cell (a file's content is not
    echoed: `schedule: /etc/shadow` must not quote it)."""
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what}: not finite")
    return value


def read_csv(lines: Iterable[str], source: str = "<csv>", loop_s: float | None = None
             ) -> Schedule:
    """Steps from `t_s,delay_ms,rate_mbit,loss_pct` lines (see the module docstring)."""
    steps: list[Step] = []
    for no, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        cells = [c.strip() for c in text.split(",")]
        if not steps and cells[0] == "t_s":
            if tuple(cells) != CSV_COLUMNS[: len(cells)]:
                raise ValueError(f"{source}:{no}: header must be {','.join(CSV_COLUMNS)}")
            continue
        if len(cells) > 4:
            raise ValueError(f"{source}:{no}: {len(cells)} columns, expected at most 4 "
                             f"({','.join(CSV_COLUMNS)})")
        values = [_number(c, f"{source}:{no}: {name}") for name, c in zip(CSV_COLUMNS, cells,
                                                                            strict=False)]
        if values[0] is None:
            raise ValueError(f"{source}:{no}: t_s is missing")
        step = Step(*values)
        if step.t_s < 0 or (steps and step.t_s <= steps[-1].t_s):
            raise ValueError(f"{source}:{no}: t_s {step.t_s:g} must be >= 0 and after the "
                             "previous step's")
        steps.append(step)
    if not steps:
        raise ValueError(f"{source}: no steps")
    if steps[0].t_s != 0:
        raise ValueError(f"{source}: the first step must be at t_s = 0")
    return Schedule(tuple(steps), loop_s, source)


def read_mahimahi(lines: Iterable[str], source: str = "<trace>",
                  bin_ms: float = DEFAULT_BIN_MS) -> Schedule:
    """A Mahimahi delivery-opportunity trace: the trace, and its rate in steps of bin_ms
    (see the module docstring)."""
    if not 1 <= bin_ms <= 10_000:
        raise ValueError(f"{source}: bin_ms must be in 1..10000, got {clip(bin_ms)}")
    trace = parse_trace(lines, source, max_ms=MAX_STEPS * bin_ms)  # bins stay <= MAX_STEPS
    period_ms = trace.stamps_ms[-1]
    bins = math.ceil(period_ms / bin_ms)
    counts = [0] * bins
    for value in trace.stamps_ms:
        counts[min(bins - 1, int(value // bin_ms))] += 1
    steps = []
    for i, count in enumerate(counts):
        width_ms = min(bin_ms, period_ms - i * bin_ms)
        rate = count * PACKET_BYTES * 8 / (width_ms / 1e3) / 1e6
        steps.append(Step(round(i * bin_ms / 1e3, 6), None, max(MIN_RATE_MBIT, round(rate, 6)),
                          None))
    return Schedule(tuple(steps), period_ms / 1e3, source, trace)


def _shown(path: str | Path) -> str:
    """A path as errors show it: as written, or clipped when it is long (it came from a file)."""
    text = str(path)
    return text if len(text) <= 160 else clip(text, 160)


def read_lines(path: str | Path, what: str = "schedule file",
               limit: int = MAX_FILE_BYTES) -> list[str]:
    """The lines of a regular text file of at most `limit` bytes; a ValueError naming the file
    otherwise (a folder, /dev/zero, a FIFO: its kind is checked before it is opened, and the
    read stops at limit + 1 bytes). The content is never quoted."""
    path = Path(path)
    where = f"{what} {_shown(path)}"
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{where}: is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: is not a regular file (a device, FIFO or socket)")
        if st.st_size > limit:
            raise ValueError(f"{where}: {st.st_size:,} bytes, more than the {limit:,} read here")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or type(exc).__name__}") from None
    if len(data) > limit:
        raise ValueError(f"{where}: more than the {limit:,} bytes read here")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not text (byte {exc.start:,} is not UTF-8)") from None
    return text.splitlines()


def read_schedule(path: str | Path, kind: str, bin_ms: float = DEFAULT_BIN_MS,
                  loop: bool = False) -> Schedule:
    """A schedule file: kind "csv" (loop: repeat after the last step + its gap) or "mahimahi"."""
    lines = read_lines(path)
    if kind == "mahimahi":
        return read_mahimahi(lines, _shown(path), bin_ms)
    if kind != "csv":
        raise ValueError(f"schedule kind must be csv or mahimahi, got {clip(kind)}")
    sched = read_csv(lines, _shown(path))
    if loop:
        times = [s.t_s for s in sched.steps]
        gap = times[-1] - times[-2] if len(times) > 1 else 1.0
        sched = Schedule(sched.steps, times[-1] + gap, sched.source)
    return sched


def rates(schedule: Schedule) -> Sequence[float]:
    """The rates the schedule sets (for sizing queues)."""
    return [s.rate_mbit for s in schedule.steps if s.rate_mbit is not None]
