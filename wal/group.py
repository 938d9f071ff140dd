"""Group commit: many appenders, one write(2) per batch, up to `max_syncs` fsyncs in flight.

Every append queues a waiter. The thread holding the writer role drains the whole queue as
one batch, writes it with one `write(payloads)`, and starts one `sync(ticket)` (the fsync)
for it. A waiter is woken only when the fsync of its own batch, and of every batch written
before it, has succeeded: so `append` returns after an fsync that began after its record
was written, and acknowledgements never run ahead of a failure.

Who holds the writer role:
- an appender that finds nobody writing and a free fsync slot: it writes and fsyncs its
  batch itself, so a lone appender pays one write and one fsync and no thread handoff;
- if more waiters queued meanwhile, the role passes to the flusher thread, which writes a
  batch whenever fewer than `max_syncs` fsyncs are in flight and hands each fsync to a
  small pool. Overlapping fsyncs matter: the kernel serves concurrent fsyncs of one file
  together, so on a slow disk a batch need not wait for the previous batch's fsync;
- an asyncio appender that finds the role free and an fsync slot free writes its batch in
  its event loop (a write to the page cache) and hands only the fsync to the pool: one
  thread hop there and one back (`call_soon_threadsafe`), where going through the flusher
  took two there. Otherwise it hands the role to the flusher. It never fsyncs in its loop.

Wakes are point to point: a sync waiter blocks on its own pre-acquired lock, released once.

A failed write or fsync poisons the committer: that batch, every batch in flight behind
it, and every later append fail with WalIOError, because after a failed fsync the page
cache can no longer be trusted. A failed write poisons it at once, before the next batch
is written: nothing goes into the file behind torn bytes.

Overlapping fsyncs and their errors: Linux reports a writeback error once per open file,
to whichever fsync of it checks first. All fsyncs of a segment share its descriptor, so
when batch A's pages fail to reach the disk, an fsync that overlaps A's (a later batch's,
or the one that seals a full segment inside a write) may take the error, and A's own fsync
return 0. So a batch is acknowledged only once every fsync or write that was in progress
when its fsync returned has returned as well (`_Batch.overlap`): if one of them failed,
the log is poisoned by then and A fails with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from wal.errors import WalClosedError, WalError, WalIOError


class _Waiter:
    __slots__ = ("payload", "lock", "loop", "future", "seq", "error")

    def __init__(self, payload: bytes | None, loop: asyncio.AbstractEventLoop | None) -> None:
        self.payload = payload  # None: a close barrier, which writes nothing
        self.loop = loop
        self.future = loop.create_future() if loop is not None else None
        self.lock = None if loop is not None else threading.Lock()
        if self.lock is not None:
            self.lock.acquire()
        self.seq = 0
        self.error: WalError | None = None

    def wake(self) -> None:
        """Called exactly once per waiter, when its batch is acknowledged or failed."""
        if self.lock is not None:
            self.lock.release()
            return
        with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_settle, self.future, self.seq, self.error)


def _settle(future: asyncio.Future, seq: int, error: WalError | None) -> None:
    if future.done():  # the awaiting task was cancelled; the record is durable regardless
        return
    if error is None:
        future.set_result(seq)
    else:
        future.set_exception(error)


class _Batch:
    __slots__ = ("waiters", "ticket", "last_seq", "synced", "error", "overlap")

    def __init__(self, waiters: list[_Waiter]) -> None:
        self.waiters = waiters
        self.ticket: object = None  # what `sync` needs; None when nothing was written
        self.last_seq = 0
        self.synced = False
        self.error: WalError | None = None
        self.overlap: list[_Batch] = []
        """Batches whose write or fsync was in progress when this one's fsync returned:
        it is acknowledged only once they have returned too (module note)."""

    def settled(self) -> bool:
        return self.synced and all(b.synced for b in self.overlap)


class GroupCommit:
    """Batches appends over `write(payloads) -> (first seq, ticket)` and `sync(ticket)`.

    `write` is only ever called by the writer-role holder, one call at a time; at most
    `max_syncs` written batches await their `sync` at once. `durable(seq)` is
    called, in seq order, each time every record up to seq is acknowledged.
    """

    def __init__(
        self,
        write: Callable[[list[bytes]], tuple[int, object]],
        sync: Callable[[object], None],
        durable: Callable[[int], None],
        name: str,
        *,
        max_syncs: int = 4,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self._write, self._sync, self._durable = write, sync, durable
        self._on_failure = on_failure
        """Told the refusal once, when the first failure poisons the log (any thread, the
        mutex held: it must not block)."""
        self._name = name
        self._max_syncs = max_syncs
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)  # a batch finished or role freed
        self._queue: deque[_Waiter] = deque()
        self._inflight: deque[_Batch] = deque()  # written, not yet acknowledged; in order
        self._busy: set[_Batch] = set()  # from the start of its write to the end of its fsync
        self._leading = False
        self._closing = False
        self._failed: str | None = None
        self._flusher: threading.Thread | None = None
        self._flusher_turn = False  # the writer role handed to the flusher, not yet taken
        self._kick = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self.batches = 0  # fsyncs that acknowledged records; the bench reports their size

    @property
    def failed(self) -> str | None:
        return self._failed

    def _enqueue(self, *waiters: _Waiter) -> str | None:
        """Queue the waiters (together: one batch unless a writer is draining). Returns who
        must now take the free writer role: "caller" (a lone appender with a free fsync
        slot) or "flusher"; None if someone holds it."""
        with self._mutex:
            if self._closing and any(w.payload is not None for w in waiters):
                raise WalClosedError(f"the log at {self._name} is closed")
            if self._failed is not None:
                raise WalIOError(self._failed)
            self._queue.extend(waiters)
            if self._leading:
                return None
            self._leading = True
            return "caller" if len(self._inflight) < self._max_syncs else "flusher"

    def commit(self, payload: bytes | None) -> int:
        """Commit one payload (None: wait for everything queued before it); block."""
        return self.commit_many([payload])[0]

    def commit_many(self, payloads: list[bytes | None]) -> list[int]:
        """Commit payloads queued together (one write and one fsync when this caller takes
        the writer role); block until every one is durable; their seqs, in order."""
        waiters = [_Waiter(payload, None) for payload in payloads]
        role = self._enqueue(*waiters)
        if role == "caller":
            self._lead_once()
        elif role == "flusher":  # every fsync slot is busy: the flusher waits for one
            self._hand_to_flusher()
        for waiter in waiters:
            waiter.lock.acquire()  # released exactly once, when its batch is acknowledged
        for waiter in waiters:
            if waiter.error is not None:
                raise waiter.error
        return [waiter.seq for waiter in waiters]

    async def commit_async(self, payload: bytes) -> int:
        """Commit one payload and await it; the event loop never waits on an fsync."""
        return (await self.commit_many_async([payload]))[0]

    async def commit_many_async(self, payloads: list[bytes]) -> list[int]:
        """Commit payloads queued together (one batch: one write and one fsync when this
        caller takes the writer role) and await them all; their seqs, in order. Only the
        last one wakes the event loop: a batch is acknowledged, or fails, as a whole."""
        if not payloads:
            return []
        loop = asyncio.get_running_loop()
        waiters = [_Waiter(p, None) for p in payloads[:-1]] + [_Waiter(payloads[-1], loop)]
        role = self._enqueue(*waiters)
        if role == "caller":  # write here, fsync in the pool
            self._lead_once(fsync=lambda batch: self._sync_pool().submit(self._finish, batch))
        elif role == "flusher":
            self._hand_to_flusher()
        await waiters[-1].future
        return [waiter.seq for waiter in waiters]

    # ---- the writer role ----------------------------------------------------------------

    def _write_batch(self) -> _Batch:
        """Drain the queue, write it, register it in flight (writer role held)."""
        with self._mutex:
            batch = _Batch(list(self._queue))
            self._queue.clear()
            self._inflight.append(batch)
            self._busy.add(batch)  # its write may fsync the segment it seals
            failed = self._failed
        payloads = [w.payload for w in batch.waiters if w.payload is not None]
        if failed is not None:
            batch.error = WalIOError(failed)
        elif payloads:
            try:
                first, batch.ticket = self._write(payloads)
            except WalError as exc:
                batch.error = exc
            except Exception as exc:  # a bug in write: the file is in an unknown state
                batch.error = WalIOError(f"write to {self._name} raised {exc!r}")
            else:
                for w in batch.waiters:
                    if w.payload is not None:
                        w.seq, first = first, first + 1
                batch.last_seq = first - 1
        if batch.error is not None:
            with self._mutex:  # before the next batch is written behind it
                self._poison(batch.error)
        return batch

    def _poison(self, error: WalError) -> None:
        """The first failure: every later append is refused (`_mutex` held)."""
        if self._failed is None:
            self._failed = f"{error}; the log refuses appends until it is reopened"
            if self._on_failure is not None:
                self._on_failure(self._failed)

    def _finish(self, batch: _Batch) -> None:
        """Fsync a written batch (any thread), then acknowledge what is now in order."""
        if batch.ticket is not None and batch.error is None:
            try:
                self._sync(batch.ticket)
            except WalError as exc:
                batch.error = exc
            except Exception as exc:
                batch.error = WalIOError(f"fsync of {self._name} raised {exc!r}")
        with self._mutex:
            batch.synced = True
            self._busy.discard(batch)
            batch.overlap = list(self._busy)
            if batch.error is not None:
                self._poison(batch.error)
            while self._inflight and self._inflight[0].settled():
                done = self._inflight.popleft()
                error = done.error
                if error is None and self._failed is not None:
                    error = WalIOError(self._failed)  # an earlier batch failed first
                if error is None and done.last_seq:
                    self._durable(done.last_seq)
                    self.batches += 1
                for w in done.waiters:
                    w.error = error
                    w.wake()
            self._changed.notify_all()

    def _lead_once(self, fsync: Callable[[_Batch], object] | None = None) -> None:
        """The lone appender's round: write, pass the role on if others queued, fsync (here,
        or through `fsync(batch)`)."""
        batch = self._write_batch()
        with self._mutex:
            handing = bool(self._queue)
            if not handing:
                self._leading = False
                self._changed.notify_all()
        if handing:
            self._hand_to_flusher()
        (fsync or self._finish)(batch)

    def _sync_pool(self) -> ThreadPoolExecutor:
        with self._mutex:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_syncs, f"wal-sync {self._name}")
            return self._pool

    def _hand_to_flusher(self) -> None:
        """Pass the writer role (held by the caller) to the flusher thread."""
        with self._mutex:
            self._flusher_turn = True
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flusher_main, name=f"wal-flush {self._name}", daemon=True
                )
                self._flusher.start()
        self._kick.set()

    def _flusher_main(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            with self._mutex:
                turn, self._flusher_turn = self._flusher_turn, False
                if not turn and self._closing and not self._leading:
                    return
            if turn:  # a kick without the turn is never a licence to write
                self._flush()

    def _flush(self) -> None:
        """Write batches while any are queued, keeping at most `max_syncs` fsyncs in flight."""
        pool = self._sync_pool()
        while True:
            with self._mutex:
                while len(self._inflight) >= self._max_syncs:
                    self._changed.wait()  # the queue grows meanwhile: a bigger next batch
                if not self._queue:
                    self._leading = False
                    self._changed.notify_all()
                    return
            pool.submit(self._finish, self._write_batch())

    def close(self) -> None:
        """Wait for everything queued and in flight, refuse new appends, stop the threads."""
        with self._mutex:
            if self._closing:
                return
            self._closing = True
        with contextlib.suppress(WalIOError):  # any failure was reported to its appender
            self.commit(None)
        with self._mutex:
            while self._leading or self._inflight:
                self._changed.wait()
            flusher = self._flusher
        if flusher is not None:
            self._kick.set()
            flusher.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
