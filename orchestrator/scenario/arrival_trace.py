"""Arrival traces of real LLM services, replayed as a workload (`arrival: trace`).

A trace is a CSV file with one request a line: when it arrived, how many prompt (context)
tokens it had and how many it generated. Two public layouts are read by their header:

* Azure LLM inference traces 2023/2024 (github.com/Azure/AzurePublicDataset, CC-BY 4.0):
  `TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP a date and time such as
  `2023-11-16 18:15:46.6805900`;
* BurstGPT (github.com/HPMLL/BurstGPT, CC-BY 4.0): `Timestamp,...,Request tokens,
  Response tokens,...`, Timestamp in seconds.

Times become seconds from the first row. The file is read as the other input files are
(`orchestrator.scenario.yamlio.read_bounded`: a regular UTF-8 file of at most 16 MiB); an error
names the file, the line and the column, and never quotes the file's content.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from orchestrator.scenario.yamlio import InputError, read_bounded

__all__ = ["MAX_TRACE_BYTES", "ArrivalTrace", "read_arrival_trace"]

MAX_TRACE_BYTES = 16 << 20

# header names of (time, prompt tokens, generated tokens), per layout
LAYOUTS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}


@dataclass(frozen=True)
class ArrivalTrace:
    """A trace's requests in arrival order: seconds from its first row, prompt and generated
    token counts as the service saw them."""

    path: str = field(compare=False)  # where it was read: the content is its identity
    layout: str
    times_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    gen_tokens: tuple[int, ...]
    sha256: str = ""

    @property
    def span_s(self) -> float:
        return self.times_s[-1] if self.times_s else 0.0


def _seconds(text: str, layout: str) -> float:
    if layout == "burstgpt":
        value = float(text)
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    day, _, clock = text.strip().partition(" ")
    hms, _, frac = clock.partition(".")
    stamp = datetime.fromisoformat(f"{day} {hms}")  # fractions of 7 digits: read below
    return stamp.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def read_arrival_trace(path: str | Path) -> ArrivalTrace:
    """The trace at `path`; InputError (a ValueError) naming the file, line and column."""
    data = read_bounded(path, MAX_TRACE_BYTES, "an arrival trace")
    file = str(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError("not UTF-8 text (an arrival trace is a CSV file)", file=file) from None
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None) or []
    names = [h.strip() for h in header]
    layout = next((k for k, cols in LAYOUTS.items() if all(c in names for c in cols)), None)
    if layout is None:
        raise InputError("the header names no known layout (Azure: TIMESTAMP, ContextTokens, "
                         "GeneratedTokens; BurstGPT: Timestamp, Request tokens, Response "
                         "tokens)", file=file, line=1)
    where = [names.index(c) for c in LAYOUTS[layout]]
    times: list[float] = []
    prompts: list[int] = []
    gens: list[int] = []
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        column = LAYOUTS[layout][0]
        try:
            t = _seconds(row[where[0]], layout)
            column = LAYOUTS[layout][1]
            prompt = int(row[where[1]])
            column = LAYOUTS[layout][2]
            gen = int(row[where[2]])
        except (ValueError, IndexError, OverflowError):
            raise InputError("is missing or not readable", file=file, line=line,
                             field=column) from None
        if prompt < 0 or gen < 0:
            raise InputError("token counts must be >= 0", file=file, line=line)
        if times and t < times[-1]:
            raise InputError("goes back in time (rows must be in arrival order)", file=file,
                             line=line, field=LAYOUTS[layout][0])
        times.append(t)
        prompts.append(prompt)
        gens.append(gen)
    if not times:
        raise InputError("no request rows after the header", file=file)
    first = times[0]
    return ArrivalTrace(file, layout, tuple(round(t - first, 6) for t in times),
                        tuple(prompts), tuple(gens), hashlib.sha256(data).hexdigest())
