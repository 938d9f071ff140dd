"""The round queue: rounds of different sessions that wait at the same time run as one batch.

Rounds are queued in arrival order; the worker takes up to `max_batch` of them, oldest
first, and runs them together in one worker thread (one target forward for the lot). No
round waits for a batch to fill: a round that arrives while the target is idle runs at once,
and the rounds that arrive while a batch computes form the next one. Each session has at most
one round queued (its session lock is held while its round waits), so first-in first-out is
also round-robin between sessions: a round waits for at most ceil(depth / max_batch) batches
ahead of it, however slow or busy any other session is.

The queue is bounded (`limits.round_queue`): a round that finds it full is refused with
`RoundQueueFullError` (gRPC RESOURCE_EXHAUSTED, reason round_queue_full) before anything is
computed or written, so the session is unchanged and the proposer may send the same request
again after a backoff.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from muser.errors import RefusedError

T = TypeVar("T")
R = TypeVar("R")


class RoundQueueFullError(RefusedError):
    """The verifier's queue of waiting rounds is full; send the same request after a backoff."""


class RoundBatcher(Generic[T, R]):
    """Queue items; run them in batches through `run` (in a worker thread, one batch at a
    time). `run(items)` returns one result or exception per item, in order."""

    def __init__(
        self,
        run: Callable[[list[T]], list[R | BaseException]],
        *,
        max_batch: int,
        max_queue: int,
        on_batch: Callable[[int, int], None] | None = None,
        on_queue: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch {max_batch} and max_queue {max_queue} must be >= 1")
        self.run, self.max_batch, self.max_queue = run, max_batch, max_queue
        self.on_batch = on_batch
        """Called with (batch size, rounds still waiting) as each batch starts."""
        self.on_queue = on_queue
        """Called with the rounds waiting once a round joined the queue."""
        self._waiting: deque[tuple[T, asyncio.Future]] = deque()
        self._worker: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        """Rounds waiting (the batch computing now not included)."""
        return len(self._waiting)

    async def enqueue(self, item: T) -> R:
        """Queue `item` and wait for its result; refuses when the queue is full."""
        if len(self._waiting) >= self.max_queue:
            raise RoundQueueFullError(
                f"the verifier's round queue is full: {len(self._waiting)} rounds waiting, "
                f"limits.round_queue is {self.max_queue}; send the same request again after "
                "a backoff"
            )
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self.on_queue is not None:
            self.on_queue(len(self._waiting))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch: list[tuple[T, asyncio.Future]] = []
            while self._waiting and len(batch) < self.max_batch:
                item, future = self._waiting.popleft()
                if not future.done():  # a cancelled waiter is skipped
                    batch.append((item, future))
            if not batch:
                continue
            if self.on_batch is not None:
                self.on_batch(len(batch), len(self._waiting))
            try:
                results = await asyncio.to_thread(self.run, [item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
            except asyncio.CancelledError:  # the loop is shutting down
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # handed to every waiter of the batch
                results = [exc] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
