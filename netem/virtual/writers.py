"""The selector both virtual loops wait in: epoll that knows which sockets still have bytes
to write.

asyncio registers a writer for a socket whose send buffer is full (what it could not hand the
kernel waits in the transport) and for a connect in progress: bytes this process will still
send. The peer's reading frees the buffer and no counted byte says so, so until every writer
is gone the process is busy: a clock advanced meanwhile would run the timeouts of answers
that were half sent (across a bridge the kernel takes a large message in many pieces, on
loopback at once).
"""

from __future__ import annotations

import selectors
from typing import Any

__all__ = ["WriterSelector"]


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
