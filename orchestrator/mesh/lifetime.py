"""One lifetime idiom for the orchestrator: concurrent work in a TaskGroup, clean-up to its end.

`together` runs awaitables in one `asyncio.TaskGroup`: every task has an owner, the first
failure cancels the others and is raised as itself (callers and users see the node's
RuntimeFailure, not an ExceptionGroup). `to_the_end` runs a clean-up in a task of its own that a
cancelled caller cannot cut short (Ctrl-C during a stop must not leave nodes, namespaces or
containers behind), and re-raises the cancellation once the clean-up is done; `undone_on_error`
does that for a start that fails or is cancelled half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["to_the_end", "together", "undone_on_error"]

T = TypeVar("T")


async def together(*aws: Coroutine[Any, Any, T]) -> list[T]:
    """The results of `aws`, run at once, in order."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(aw) for aw in aws]
        return [t.result() for t in tasks]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


async def to_the_end(cleanup: Awaitable[None]) -> None:
    """Await `cleanup` to its end even if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(cleanup)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise


@contextlib.asynccontextmanager
async def undone_on_error(undo: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Run the block; if it fails or is cancelled, `undo()` to its end, then re-raise (a start
    that stops half-way leaves nothing it made behind)."""
    try:
        yield
    except BaseException:
        await to_the_end(undo())
        raise
