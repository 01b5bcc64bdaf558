"""Errors of the edge node (server side) and of its client.

Server side: a handler raises a `ServiceError`; the node's middleware turns it into the answer
`{"error": code, "detail": text}` with the status below (docs/contracts.md). Nothing else reaches
the client, so a bad request can never take the node down.

    ServiceError                    500 internal (a bug; logged)
    ├── BadRequest                  400 malformed: the detail names the field and the value
    ├── Unauthorized                401 unauthorized: missing or wrong control-plane token
    ├── NotPlaced                   404 not_placed: expert or variant not on this node
    ├── DoesNotFit                  409 does_not_fit: a placement larger than the node's memory
    ├── TooLarge                    413 too_large: a body over the node's size limit
    └── Unavailable                 503 overloaded | shutting_down | injected_fault

Client side (`services.client`): what a caller of another node can meet.

    NodeError                       base
    ├── NodeRefused                 the node answered with an error status (status, code, detail)
    ├── NodeUnreachable             connection refused, reset or closed (also ConnectionError)
    └── NodeTimeout                 no answer within the settings' limit (also TimeoutError)

Retry only `NodeUnreachable`, `NodeTimeout` and `NodeRefused` with status 503, elsewhere.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "DoesNotFit",
    "NodeError",
    "NodeRefused",
    "NodeTimeout",
    "NodeUnreachable",
    "NotPlaced",
    "ServiceError",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
]


class ServiceError(Exception):
    """An error the node answers with; `status` and `code` go on the wire, the message too.
    A subclass names its own in its class line: `class X(ServiceError, status=.., code=..)`."""

    status = 500
    code = "internal"

    def __init_subclass__(cls, status: int = 0, code: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if status:
            cls.status = status
        if code:
            cls.code = code

    def __init__(self, detail: str, code: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code

    def body(self) -> dict[str, str]:
        return {"error": self.code, "detail": self.detail}


class BadRequest(ServiceError, ValueError, status=400, code="malformed"):
    """The request's body or query is malformed: the detail names the field and the value."""


class Unauthorized(ServiceError, status=401, code="unauthorized"):
    """A control-plane call without the right token."""


class NotPlaced(ServiceError, LookupError, status=404, code="not_placed"):
    """The expert or variant asked for is not on this node."""


class DoesNotFit(ServiceError, ValueError, status=409, code="does_not_fit"):
    """A placement larger than the node's memory."""


class TooLarge(ServiceError, status=413, code="too_large"):
    """A body over the node's size limit."""


class Unavailable(ServiceError, status=503, code="overloaded"):
    """503: `code` says why (overloaded, shutting_down, injected_fault)."""


class NodeError(Exception):
    """Base of what the node client raises; `url` is the node that failed."""

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class NodeRefused(NodeError):
    """The node answered, with an error status."""

    def __init__(self, url: str, status: int, code: str, detail: str) -> None:
        super().__init__(f"{url}: {status} {code}: {detail}", url)
        self.status = status
        self.code = code
        self.detail = detail

    @property
    def retryable(self) -> bool:
        return self.status == 503


class NodeUnreachable(NodeError, ConnectionError):
    """No connection, or the connection broke before an answer came."""


class NodeTimeout(NodeError, TimeoutError):
    """The node did not answer within the limit."""
