"""Marks on what moemesh makes, so that it deletes or overwrites only that.

Every folder the tool creates holds a marker file, `.moemesh-marker`: JSON with the tool, what
the folder is (`kind`: mesh, run, work, logs), the id of the run or mesh that made it, and
the creating process (pid and start time, so `moemesh clean` can tell a live owner from a
dead one: `process_start_ticks`, `process_alive`, which the runtimes use to name their node
processes too). Kernel objects carry the id in their names (netns `mm<id>-<node>`, veths
`mv<id>…`, bridge `mmbr<id>`, an iptables rule commented `moemesh-<id>`); containers carry
labels. `moemesh down`, the stale clean-up of `up`, `--out` and `moemesh clean` refuse a
folder without a marker and say what they found in it.

State folders (`moemesh up`'s default) must also be private: owned by this user, mode 0700,
not a link; another local user cannot plant one for us (`private_dir`).

Beside the marker, a manifest, `.moemesh-manifest`, lists what the tool made in the folder
(one relative name a line: a file, or a subfolder it made whole), written when the folder is
marked and appended to (`record`) before each thing is made. `remove_recorded` (`moemesh
clean`, `down`) removes only those entries, the manifest and the marker, then the folder if
nothing else is left: a marker alone (forged, copied, or from before manifests) removes
nothing, and a file the tool did not record stays where it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["MANIFEST", "MARKER", "NotOurs", "describe", "mark", "marker", "new_id", "owner_alive",
           "private_dir", "process_alive", "process_start_ticks", "record", "recorded",
           "remove_ours", "remove_recorded", "require_ours", "restore", "update"]

MARKER = ".moemesh-marker"
MANIFEST = ".moemesh-manifest"
TOOL = "moemesh"


class NotOurs(ValueError):
    """A folder or file moemesh did not make (or may not trust); the message says what was
    found. A ValueError: the CLI answers exit 2."""


def new_id() -> str:
    """A short run or mesh id (8 hex digits): short enough for interface names."""
    return secrets.token_hex(4)


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None
    when it does not exist: with the pid it names one process, never a later reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Is this exact process (pid and start time) still there and not a zombie?"""
    ticks = process_start_ticks(pid)
    if ticks is None or (start_ticks is not None and ticks != start_ticks):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().decode(errors="replace")
    except OSError:
        return False
    return state[state.rfind(")") + 2:][:1] != "Z"


def mark(folder: Path, kind: str, run_id: str | None = None, made: Iterable[str] = (),
         **extra: Any) -> str:
    """Create `folder` if needed and write its marker, and its manifest with `made` (the
    names the caller is about to make there, `record`); returns the id."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record(folder, *made)
    run_id = run_id or new_id()
    data = {"tool": TOOL, "kind": kind, "id": run_id, "pid": os.getpid(),
            "start_ticks": process_start_ticks(os.getpid()), "uid": os.getuid(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, folder / MARKER)
    return run_id


def _entry(name: str) -> str:
    """A manifest entry: a relative name inside the folder, never out of it."""
    path = PurePosixPath(name)
    if (not name or "\n" in name or path.is_absolute() or ".." in path.parts
            or path.parts[0] in (MARKER, MANIFEST)):
        raise ValueError(f"not a name inside a marked folder: {name!r}")
    return str(path)


def record(folder: Path, *names: str) -> None:
    """Add `names` to the folder's manifest (created if absent): call it before making them,
    so that a run killed right after still has them listed."""
    entries = [_entry(n) for n in names]
    with open(Path(folder) / MANIFEST, "a") as fh:
        fh.writelines(e + "\n" for e in entries)


def recorded(folder: Path) -> list[str] | None:
    """The names the manifest lists (first mention, in order), or None when there is none."""
    try:
        lines = (Path(folder) / MANIFEST).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    out: list[str] = []
    for line in lines:
        try:
            name = _entry(line)
        except ValueError:
            continue  # a line that would leave the folder is ignored, never followed
        if name not in out:
            out.append(name)
    return out


def remove_recorded(folder: Path) -> list[str]:
    """Remove what the manifest lists (a link as a link, never followed; a recorded subfolder
    whole), then the manifest and the marker, then the folder if it is empty. Returns the names
    left in it (what the tool did not record). Without a manifest nothing is removed."""
    folder = Path(folder)
    names = recorded(folder)
    if names is None:
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    for name in sorted(names, key=lambda n: -len(PurePosixPath(n).parts)):
        path = folder / name
        if any((folder / Path(*PurePosixPath(name).parts[:i])).is_symlink()
               for i in range(1, len(PurePosixPath(name).parts))):
            continue  # under a link: not inside this folder any more
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    for name in (MANIFEST, f"{MARKER}.tmp", MARKER):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return left


def marker(folder: Path) -> dict[str, Any] | None:
    """The folder's marker, or None when it has none (or not a readable one of ours)."""
    try:
        data = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == TOOL else None


def update(folder: Path, **fields: Any) -> None:
    """Change fields of an existing marker (a run's `status`)."""
    data = marker(folder)
    if data is None:
        return
    data.update(fields)
    restore(folder, data)


def restore(folder: Path, data: dict[str, Any]) -> None:
    """Write `data` as the folder's marker, whole (one read earlier, given back)."""
    tmp = Path(folder) / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, Path(folder) / MARKER)


def describe(folder: Path, limit: int = 6) -> str:
    """What a folder holds, for a refusal: "3 entries: a, b, c"."""
    try:
        names = sorted(p.name for p in Path(folder).iterdir())
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if not names:
        return "nothing"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: " \
           f"{', '.join(names[:limit])}{more}"


def require_ours(folder: Path, what: str, kind: str | None = None) -> dict[str, Any]:
    """The folder's marker; NotOurs (naming what is there) when it has none or another
    kind's."""
    data = marker(folder)
    if data is None:
        raise NotOurs(f"{what} {folder} was not made by moemesh (no {MARKER} in it; it holds "
                      f"{describe(folder)}): refusing to delete or overwrite it")
    if kind is not None and data.get("kind") != kind:
        raise NotOurs(f"{what} {folder} is a moemesh {data.get('kind')} folder, not a {kind} "
                      f"folder: refusing to delete or overwrite it")
    return data


def remove_ours(folder: Path, what: str, kind: str | None = None) -> list[str]:
    """Delete what moemesh recorded it made in a marked folder (`remove_recorded`), and the
    folder when nothing else is left; NotOurs without the marker. Returns the names kept.
    Gone: no-op."""
    folder = Path(folder)
    if not folder.exists():
        return []
    require_ours(folder, what, kind)
    return remove_recorded(folder)


def owner_alive(data: dict[str, Any]) -> bool:
    """Whether the process that wrote a marker still runs (pid and start time)."""
    pid = data.get("pid")
    return isinstance(pid, int) and process_alive(pid, data.get("start_ticks"))


def private_dir(folder: Path) -> Path:
    """Create `folder` mode 0700, or check an existing one is a real folder owned by this user
    and closed to others; NotOurs says what is wrong (another user could have made it)."""
    folder = Path(folder)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=True)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotOurs(f"state folder {folder} is not a folder (a link or a file): refusing "
                      "to use it; remove it or give --mesh-dir")
    if st.st_uid != os.getuid():
        raise NotOurs(f"state folder {folder} belongs to uid {st.st_uid}, not to you (uid "
                      f"{os.getuid()}): refusing to trust it; give --mesh-dir")
    if st.st_mode & 0o077:
        raise NotOurs(f"state folder {folder} is open to others (mode "
                      f"{stat.S_IMODE(st.st_mode):o}, want 700): refusing to trust it; "
                      "remove it or give --mesh-dir")
    return folder
