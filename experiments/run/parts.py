"""A run folder that loses nothing: each finished policy's rows on disk as soon as it finishes.

A run of N policies x R repetitions is N x R *parts* (plus the overhead run, one more). While
a part runs, its token rows stream to `parts/.KEY.partial/tokens.csv`, one request's rows at
a time, flushed; when it finishes, its files are completed there (tokens sorted, requests,
routing decisions, `part.json` with its share of run.json), each written and fsynced, and the
folder is renamed to `parts/KEY` (a rename is atomic: a part is there whole or not at all).
Then the folder's top-level files (`tokens.csv`, `requests.csv`, `routing.jsonl`, the
overhead CSVs, `run.json`) are rebuilt from the finished parts, each by write, fsync, rename,
so that at every moment they hold every finished part and nothing half-written. A `kill -9`
loses at most the part in flight; its streamed rows stay in `parts/.KEY.partial/` for
inspection (a report does not count them), and `moemesh run --resume` runs it again.

KEY is the part's run.json key: the arm's label in repetition 0, `LABEL#repN` after
(experiments.run.repeats), `overhead` for the zero-delay run. File names escape `/` and other
characters a label may hold.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .routing import ROUTING_FILE
from .rows import RequestRow, TokenRow, cell, write_rows

if TYPE_CHECKING:
    from .runmeta import RunMeta

__all__ = ["OVERHEAD", "PARTS", "PartStream", "RunFolder", "missing", "write_atomic"]

PARTS = "parts"
OVERHEAD = "overhead"
PART_FILE = "part.json"
_PARTIAL = ".partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    """`path` holds `text` whole or keeps what it held: write a sibling, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        fh.write(text.encode() if isinstance(text, str) else text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _synced(path: Path) -> None:
    with path.open("rb+") as fh:
        os.fsync(fh.fileno())


def _safe(key: str) -> str:
    """A file name for a part key (labels may hold `/`, `:` or spaces)."""
    return "".join(c if c.isalnum() or c in "-_.#+=" else f"%{ord(c):02x}" for c in key)


class PartStream:
    """The token rows of the part in flight, appended and flushed as each request finishes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fh: IO[str] = (folder / "tokens.csv").open("w", newline="")
        self._names = [f.name for f in fields(TokenRow)]
        self._csv = csv.writer(self._fh)
        self._csv.writerow(self._names)
        self.rows = 0

    def add(self, rows: Iterable[TokenRow]) -> None:
        for row in rows:
            data = asdict(row)
            self._csv.writerow([cell(data[k]) for k in self._names])
            self.rows += 1
        self._fh.flush()  # to the OS: a killed process keeps it (a reboot may not)

    def close(self) -> None:
        """Close the file (again is fine): `finish` does, and the runner does when the part
        fails, leaving what was streamed."""
        if not self._fh.closed:
            self._fh.close()


class RunFolder:
    """The parts of one run folder: streaming the one in flight, finishing it, listing the
    finished ones, and rebuilding the top-level files from them (module docstring)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.parts = out / PARTS

    def path(self, key: str) -> Path:
        return self.parts / _safe(key)

    def done(self, key: str) -> bool:
        return (self.path(key) / PART_FILE).is_file()

    def partial(self) -> dict[str, int]:
        """Parts that were in flight when a run stopped: key → token rows streamed."""
        out = {}
        for d in sorted(self.parts.glob(f".*{_PARTIAL}")) if self.parts.is_dir() else ():
            key = d.name[1:-len(_PARTIAL)]
            try:
                with (d / "tokens.csv").open() as fh:
                    out[key] = max(0, sum(1 for _ in fh) - 1)
            except OSError:
                out[key] = 0
        return out

    def start(self, key: str) -> PartStream:
        """A fresh in-flight folder for `key` (a leftover one from a killed run is dropped)."""
        self.parts.mkdir(parents=True, exist_ok=True)
        tmp = self.parts / f".{_safe(key)}{_PARTIAL}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return PartStream(tmp)

    def finish(self, key: str, stream: PartStream, tokens: Sequence[TokenRow],
               requests: Sequence[RequestRow], routing: Sequence[Mapping[str, Any]],
               part: Mapping[str, Any]) -> None:
        """Complete the part's files, fsync them, and rename its folder into place."""
        stream.close()
        tmp = stream.folder
        write_rows(tmp / "tokens.csv", tokens, TokenRow)  # sorted, replacing the stream
        write_rows(tmp / "requests.csv", requests, RequestRow)
        with (tmp / ROUTING_FILE).open("w") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in routing)
        (tmp / PART_FILE).write_text(json.dumps({"key": key, **part}, indent=1) + "\n")
        for f in tmp.iterdir():
            _synced(f)
        _fsync_dir(tmp)
        final = self.path(key)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.parts)

    def part(self, key: str) -> dict[str, Any]:
        """A finished part's part.json (ValueError naming the file when it is not JSON)."""
        path = self.path(key) / PART_FILE
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from None

    def rebuild(self, keys: Sequence[str], meta: Mapping[str, Any]) -> None:
        """The top-level files from the finished parts among `keys` (in that order; the
        overhead part goes to overhead*.csv), then run.json: each written atomically."""
        done = [k for k in keys if self.done(k)]
        arms = [k for k in done if k != OVERHEAD]
        self._concat("tokens.csv", arms)
        self._concat("requests.csv", arms)
        self._concat(ROUTING_FILE, arms, header=False)
        if OVERHEAD in done:
            self._concat("overhead.csv", [OVERHEAD], source="tokens.csv")
            self._concat("overhead_requests.csv", [OVERHEAD], source="requests.csv")
        write_atomic(self.out / "run.json", json.dumps(meta, indent=1) + "\n")

    def _concat(self, name: str, keys: Sequence[str], *, header: bool = True,
                source: str | None = None) -> None:
        tmp = self.out / f".{name}.tmp"
        with tmp.open("w", newline="") as fh:
            first = True
            for key in keys:
                with (self.path(key) / (source or name)).open(newline="") as part:
                    head = part.readline() if header else ""
                    if first and head:
                        fh.write(head)
                    first = False
                    shutil.copyfileobj(part, fh)
            if first and header:  # no part yet: the header alone
                kind = TokenRow if (source or name) == "tokens.csv" else RequestRow
                fh.write(",".join(f.name for f in fields(kind)) + "\r\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.out / name)
        _fsync_dir(self.out)



def missing(meta: RunMeta) -> dict[str, str]:
    """Parts a run planned and has not finished (run.json `parts`) → why: the run's error,
    or that it stopped (killed, or still going) when run.json was last written."""
    parts = meta.parts
    if parts is None:
        return {}  # a run made before parts: complete, or its error says what happened
    done = set(parts.get("done") or ())
    partial = parts.get("partial") or {}
    state = parts.get("state")
    if state == "failed":
        why = f"not run: the run failed ({meta.error or 'no error recorded'})"
    elif state == "running":
        why = ("not run: the run stopped before it (killed, or still running when run.json "
               "was last written); `moemesh run --resume DIR` runs it")
    else:
        why = "not run"
    out = {}
    for key in parts.get("planned") or ():
        if key in done:
            continue
        out[key] = why
        if key in partial:
            out[key] = (f"{why}; it was in flight: {partial[key]} token rows streamed to "
                        f"{PARTS}/.{_safe(key)}{_PARTIAL}/tokens.csv, not counted here")
    return out
