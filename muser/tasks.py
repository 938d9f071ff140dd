"""Fire-and-forget coroutines: started on the running loop, not awaited by anyone.

The event loop keeps only weak references to its tasks, so a task nobody holds may be
collected before it ends; `in_background` holds each one until it is done, and logs its
failure (naming what it was) instead of leaving an exception nobody retrieves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

log = logging.getLogger("muser")

_held: set[asyncio.Future] = set()


def in_background(coro: Coroutine, what: str, logger: logging.Logger = log) -> asyncio.Future:
    """Run `coro` beside the caller; a failure is logged as "`what` failed", never raised."""
    task = asyncio.ensure_future(coro)
    _held.add(task)

    def done(t: asyncio.Future) -> None:
        _held.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.warning("%s failed: %s", what, t.exception())

    task.add_done_callback(done)
    return task


def shielded(coro: Coroutine) -> asyncio.Future:
    """Run `coro` as a task the caller's cancellation does not interrupt (a transaction a
    client that goes away mid-fsync cannot leave half applied); await the result."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return asyncio.shield(task)
