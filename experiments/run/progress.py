"""The live display of a run: policy, requests done, tokens, live mean and p99 token latency.

On a terminal it is a rich table redrawn a few times a second, one line per policy (done
policies stay); elsewhere (CI logs, pipes) it prints one plain line per policy every
`every_s` seconds and when the policy ends. Latencies are scenario milliseconds, warm-up
excluded, from the same HDR histogram class as the report.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..analysis.metrics import LatencyHist
from .rows import RequestRow, TokenRow

__all__ = ["RunProgress"]


@dataclass
class _Line:
    label: str
    total: int | None
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    ok: int = 0
    failed: int = 0
    hist: LatencyHist = field(default_factory=LatencyHist)
    ended: float | None = None

    def cells(self) -> list[str]:
        req = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        mean, p99 = self.hist.mean(), self.hist.pct(99.0)
        elapsed = (self.ended or time.monotonic()) - self.started
        return [self.label, req, f"{self.ok}", f"{self.failed}",
                "-" if math.isnan(mean) else f"{mean:.1f}",
                "-" if math.isnan(p99) else f"{p99:.1f}", f"{elapsed:.0f} s",
                "done" if self.ended else "running"]

    def text(self) -> str:
        c = self.cells()
        return (f"{c[0]}: requests {c[1]}, tokens {c[2]} ok / {c[3]} failed, "
                f"mean {c[4]} ms, p99 {c[5]} ms, {c[6]} ({c[7]})")


class RunProgress:
    """Use as a context manager around the run; call `arm`, `on_request`, `end_arm`."""

    HEADERS = ("policy", "requests", "tokens ok", "failed", "mean ms", "p99 ms", "wall",
               "state")

    def __init__(self, title: str, console: Console | None = None, *, quiet: bool = False,
                 every_s: float = 10.0) -> None:
        self.console = console or Console(stderr=True)
        self.title = title
        self.quiet = quiet
        self.every_s = every_s
        self.lines: list[_Line] = []
        self._live: Live | None = None
        self._last_print = 0.0

    def __enter__(self) -> RunProgress:
        if not self.quiet and self.console.is_terminal:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None

    def _table(self) -> Table:
        table = Table(title=self.title, title_justify="left")
        for h in self.HEADERS:
            table.add_column(h, justify="left" if h in ("policy", "state") else "right")
        for line in self.lines:
            table.add_row(*line.cells())
        return table

    def note(self, text: str) -> None:
        """A line of its own (phase changes: starting the mesh, scoring quality, ...)."""
        if self.quiet:
            return
        console = self._live.console if self._live is not None else self.console
        console.print(text, highlight=False, soft_wrap=True)

    def arm(self, label: str, total: int | None) -> None:
        self.lines.append(_Line(label, total))
        self._refresh(force=True)

    def on_request(self, row: RequestRow, tokens: list[TokenRow]) -> None:
        line = self.lines[-1]
        line.done += 1
        for t in tokens:
            if t.ok:
                line.ok += 1
                if not t.warmup:
                    line.hist.add(t.latency_ms)
            else:
                line.failed += 1
        self._refresh()

    def end_arm(self) -> None:
        self.lines[-1].ended = time.monotonic()
        self._refresh(force=True)

    def _refresh(self, force: bool = False) -> None:
        if self.quiet or not self.lines:
            return
        if self._live is not None:
            self._live.update(self._table())
            return
        t = time.monotonic()
        if force or t - self._last_print >= self.every_s:
            self._last_print = t
            self.console.print(self.lines[-1].text(), highlight=False, soft_wrap=True)
