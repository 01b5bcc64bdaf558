"""What both virtual loops (participant.VirtualLoop, partition.PartitionLoop) share: the
selector they wait in, which knows which sockets still have bytes to write, and the loop's
count of thread jobs not yet back. Either keeps the process busy: its clock may not move.

asyncio registers a writer for a socket whose send buffer is full (what it could not hand the
kernel waits in the transport) and for a connect in progress: bytes this process will still
send. The peer's reading frees the buffer and no counted byte says so, so until every writer
is gone the process is busy: a clock advanced meanwhile would run the timeouts of answers
that were half sent (across a bridge the kernel takes a large message in many pieces, on
loopback at once).
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Callable
from typing import Any

__all__ = ["CountingLoop", "WriterSelector"]


class WriterSelector(selectors.EpollSelector):
    """Epoll that keeps `_writers`: the fds registered for writing."""

    def __init__(self) -> None:
        super().__init__()
        self._writers: set[int] = set()

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = super().register(fileobj, events, data)
        self._note(key.fd, events)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = super().modify(fileobj, events, data)
        self._note(key.fd, events)
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        key = super().unregister(fileobj)
        self._writers.discard(key.fd)
        return key

    def _note(self, fd: int, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._writers.add(fd)
        else:
            self._writers.discard(fd)


class CountingLoop(asyncio.SelectorEventLoop):
    """A selector loop that knows its earliest timer and tells `_count_jobs` of each executor
    job (a device batch) as it goes out (+1) and comes back (-1)."""

    def _count_jobs(self, change: int) -> None:
        raise NotImplementedError

    def next_deadline(self) -> float:
        """When the earliest timer is due (inf: none)."""
        scheduled = self._scheduled  # type: ignore[attr-defined]
        return scheduled[0].when() if scheduled else math.inf

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any
                        ) -> asyncio.Future:
        fut = super().run_in_executor(executor, func, *args)
        self._count_jobs(1)
        fut.add_done_callback(lambda _: self._count_jobs(-1))
        return fut
