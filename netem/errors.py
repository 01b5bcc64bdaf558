"""Exceptions of `netem`.

    NetemError                       base of everything below except LinkDownError
    ├── BadLinkInput (ValueError)    input a user can fix: unknown peer, missing address,
    │                                namespace or interface that does not exist, bad string
    ├── BackendUnavailable           the chosen backend cannot run here (the message says why
    │                                and what to do: root, NET_ADMIN, sch_netem, the kernel lab)
    └── TcError                      the kernel refused a tc operation; names the operation
    LinkDownError (ConnectionError)  app backend: a send on a link that is down (blackhole)

`BadLinkInput` is a ValueError so `moemesh` maps it to exit code 2.
"""

from __future__ import annotations

__all__ = ["BackendUnavailable", "BadLinkInput", "LinkDownError", "NetemError", "TcError"]


class NetemError(Exception):
    """Base of netem's own errors."""


class BadLinkInput(NetemError, ValueError):
    """Input that names something that does not exist or cannot be shaped."""


class BackendUnavailable(NetemError):
    """A shaping backend cannot work on this host; the message says why and what to do."""


class TcError(NetemError):
    """The kernel answered a tc operation with an error; `op` is the failed operation."""

    def __init__(self, message: str, op: object = None) -> None:
        super().__init__(message)
        self.op = op


class LinkDownError(ConnectionError):
    """Raised by the app backend's `transmit` when the link stays down past the wait."""
