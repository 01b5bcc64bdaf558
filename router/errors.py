"""Errors of the router.

    RouterError                      base
    ├── BadRouterInput (ValueError)  input a user can fix: an unknown policy, node or variant,
    │                                a malformed mesh view, a bad setting (the message names it)
    ├── NoFeasiblePlan               no reachable replica can serve an expert within the token's
    │                                quality budget (the message names layer, expert and why)
    ├── TokenFailed                  a token could not complete inside its deadline; `reason`
    │                                is a short code (no_replica_reachable, ...)
    └── PeerBug                      a peer answered 4xx/5xx that is no fault of the network
                                     (a malformed request, a crash in its handler): a bug that
                                     fails the request loudly (502 peer_bug), never a replan

`BadRouterInput` is a ValueError so `moemesh` maps it to exit code 2 and the HTTP endpoints to
400. Only `NoFeasiblePlan` and the client's retryable errors make the dispatcher replan.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BadRouterInput", "NoFeasiblePlan", "PeerBug", "RouterError", "TokenFailed"]


class RouterError(Exception):
    """Base of the router's own errors."""


class BadRouterInput(RouterError, ValueError):
    """Input the caller can fix; the message names the bad value."""

    @classmethod
    def unknown(cls, what: str, name: str, known: Iterable[str]) -> BadRouterInput:
        """A name looked up where it is not: the message lists the names that are."""
        return cls(f"unknown {what} {name!r}; known: {', '.join(sorted(known))}")


class NoFeasiblePlan(RouterError):
    """No candidate replica survives for one expert of a layer (even the fallback)."""

    def __init__(self, layer: int, expert: int, why: str) -> None:
        super().__init__(f"no feasible replica for expert {expert} on layer {layer}: {why}")
        self.layer = layer
        self.expert = expert
        self.why = why


class TokenFailed(RouterError):
    """A token ended without an answer; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PeerBug(RouterError):
    """A peer refused a forward with a status that names a bug, not a fault (see
    `router.transport.is_bug`); the message is the peer's own."""

    def __init__(self, node: str, exc: BaseException) -> None:
        super().__init__(f"peer {node} answered a bug, not a fault: {exc}")
        self.node = node
