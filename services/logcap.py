"""A size cap on the node's log: the file its stdout and stderr go to, rotated in place.

The runtimes (local, netns, the fork server) open `NAME.log` in append mode and hand it to the
node process as stdout and stderr, so the node cannot reopen it, and a long run with a noisy
node (a warning per failed request) would grow it without end. `LogCap` checks the file
every few seconds from the node's own loop; past `max_bytes` it copies the file to
`NAME.log.1` (replacing the previous one) and truncates it to zero ("copytruncate"): every
writer has the file in O_APPEND mode, so the next write lands at the new end. At most
2 x max_bytes of log are kept per node. A descriptor that is not a regular file (a terminal,
a pipe: docker's log driver has its own rotation) or not in append mode (truncating it would
leave a hole before the writer's offset) is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import stat
from pathlib import Path

__all__ = ["LogCap"]


class LogCap:
    """Keeps the regular files behind `fds` under `max_bytes` (see the module docstring)."""

    def __init__(self, max_bytes: int, *, fds: tuple[int, ...] = (1, 2),
                 every_s: float = 5.0) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.every_s = every_s
        self.rotations = 0
        self._fds: dict[tuple[int, int], int] = {}  # (device, inode) → one fd writing to it
        for fd in fds:
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if (stat.S_ISREG(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND):
                    self._fds.setdefault((st.st_dev, st.st_ino), fd)

    @property
    def files(self) -> list[Path]:
        """The log files this cap watches."""
        return [Path(os.readlink(f"/proc/self/fd/{fd}")) for fd in self._fds.values()]

    def check(self) -> int:
        """Rotate every watched file past the cap now; returns how many were rotated."""
        done = 0
        for fd in self._fds.values():
            try:
                if os.fstat(fd).st_size <= self.max_bytes:
                    continue
                path = Path(os.readlink(f"/proc/self/fd/{fd}"))
                if not path.is_file():  # deleted or replaced under us: nothing to rotate
                    continue
                kept = path.with_name(path.name + ".1")
                shutil.copyfile(path, kept)
                os.ftruncate(fd, 0)
                done += 1
            except OSError:
                continue  # a full disk, a vanished file: the node goes on, unrotated
        self.rotations += done
        return done

    async def run(self) -> None:
        """Check every `every_s` seconds until cancelled (a task the node owns)."""
        if not self._fds:
            return
        while True:
            await asyncio.sleep(self.every_s)
            self.check()
