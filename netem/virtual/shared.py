"""The mesh's one clock word, in a small shared file every process of the run maps.

Layout (32 bytes): a sequence number (odd while the writer is in the middle of a change), the
mode (0: real time, 1: virtual), and the pair (v0, w0). In real time the clock reads
`v0 + perf_counter() - w0` (it runs at the wall's pace); in virtual time it reads `v0` and
moves only when the authority (netem.virtual.authority) advances it. Only the authority
writes; readers retry when the sequence number moved under them (a seqlock), so a reader
never sees half a change and the clock never runs backwards across a change of mode.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

__all__ = ["REALTIME", "VIRTUAL", "SharedClock"]

REALTIME, VIRTUAL = 0, 1
_LAYOUT = struct.Struct("<QQdd")  # seq, mode, v0, w0
_SEQ = struct.Struct("<Q")
_perf = time.perf_counter


class SharedClock:
    """A view of the clock file: `now()` for every process, `set()` for the authority."""

    def __init__(self, path: str | Path, *, create: bool = False) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, _LAYOUT.size)
            self._mm = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        if create:
            w = _perf()
            _LAYOUT.pack_into(self._mm, 0, 0, REALTIME, w, w)

    def read(self) -> tuple[int, float]:
        """(mode, now) read consistently."""
        mm = self._mm
        while True:
            seq, mode, v0, w0 = _LAYOUT.unpack_from(mm)
            t = v0 if mode == VIRTUAL else v0 + (_perf() - w0)
            if not seq & 1 and _SEQ.unpack_from(mm)[0] == seq:
                return mode, t

    def now(self) -> float:
        return self.read()[1]

    @property
    def virtual(self) -> bool:
        return self.read()[0] == VIRTUAL

    def set(self, mode: int, value: float) -> None:
        """Make the clock read `value` now, in `mode` (authority only)."""
        mm = self._mm
        seq = _SEQ.unpack_from(mm)[0]
        _SEQ.pack_into(mm, 0, seq + 1)
        _LAYOUT.pack_into(mm, 0, seq + 1, mode, value, _perf())
        _SEQ.pack_into(mm, 0, seq + 2)

    def close(self) -> None:
        self._mm.close()
