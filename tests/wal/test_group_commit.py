"""Group commit and durability: who waits for which fsync, and what a failed one does."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest

from wal import FileLog, Record, _fs
from wal.errors import WalClosedError, WalIOError
from wal.group import GroupCommit


class GatedFsync:
    """Replaces fsync: counts calls, records the file size each one saw, can be held shut."""

    def __init__(self, monkeypatch) -> None:
        self.real = _fs.fsync_file
        self.calls: list[int] = []  # file size at each fsync of a segment
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        monkeypatch.setattr(_fs, "fsync_file", self)

    def __call__(self, fd: int) -> None:
        self.calls.append(os.fstat(fd).st_size)
        self.entered.set()
        assert self.open.wait(timeout=30)
        self.real(fd)


class GatedWrite:
    """Replaces write_all: the first caller blocks inside its write until `open` is set."""

    def __init__(self, monkeypatch) -> None:
        self.real = _fs.write_all
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        monkeypatch.setattr(_fs, "write_all", self)

    def __call__(self, fd: int, data: bytes) -> None:
        self.calls += 1
        self.entered.set()
        assert self.open.wait(timeout=30)
        self.real(fd, data)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_append_returns_only_after_an_fsync_that_covers_its_record(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        gate = GatedFsync(monkeypatch)
        for i in range(5):
            log.append(b"x" * i)
            size = (tmp_path / "seg-00000000000000000001.wal").stat().st_size
            assert gate.calls[-1] == size  # the last fsync began after the whole record


def test_appenders_queued_behind_a_write_share_one_write_and_one_fsync(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        fsyncs = GatedFsync(monkeypatch)
        gate = GatedWrite(monkeypatch)
        seqs: dict[int, int] = {}
        first = threading.Thread(target=lambda: seqs.setdefault(0, log.append(b"first")))
        first.start()
        assert gate.entered.wait(timeout=30)  # the writer role is held inside write(2)
        others = [
            threading.Thread(target=lambda i=i: seqs.setdefault(i, log.append(b"w%d" % i)))
            for i in range(1, 9)
        ]
        for thread in others:
            thread.start()
        wait_for(lambda: len(log._group._queue) == 8)
        gate.open.set()
        for thread in [first, *others]:
            thread.join()
        assert (gate.calls, len(fsyncs.calls), log._group.batches) == (2, 2, 2)
        assert seqs[0] == 1 and sorted(seqs.values()) == list(range(1, 10))
        assert [r.payload for r in log.records(2)] == sorted(
            (b"w%d" % i for i in range(1, 9)), key=lambda p: seqs[int(p[1:])]
        )


def test_append_many_is_one_write_and_one_fsync_when_nobody_else_writes(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        fsyncs = GatedFsync(monkeypatch)
        assert log.append_many([b"r%d" % i for i in range(6)]) == [1, 2, 3, 4, 5, 6]
        assert len(fsyncs.calls) == 1 and log._group.batches == 1
        assert fsyncs.calls[0] == (tmp_path / "seg-00000000000000000001.wal").stat().st_size
        assert log.last_seq == 6


def test_append_many_async_is_one_write_and_one_fsync_when_nobody_else_writes(
    tmp_path, monkeypatch
):
    with FileLog(tmp_path) as log:
        fsyncs = GatedFsync(monkeypatch)
        assert asyncio.run(log.append_many_async([b"committed", b"prepared"])) == [1, 2]
        assert len(fsyncs.calls) == 1 and log._group.batches == 1
        assert fsyncs.calls[0] == (tmp_path / "seg-00000000000000000001.wal").stat().st_size


def test_a_lone_append_async_writes_in_its_loop_and_fsyncs_in_the_pool(tmp_path, monkeypatch):
    """No flusher thread for a lone asyncio appender: the write is made in the event loop's
    thread, the fsync in another, and the append returns after that fsync."""
    with FileLog(tmp_path) as log:
        writers: list[str] = []
        real_write = _fs.write_all
        monkeypatch.setattr(
            _fs,
            "write_all",
            lambda fd, data: (
                writers.append(threading.current_thread().name),
                real_write(fd, data),
            ),
        )
        syncers: list[str] = []
        real_fsync = _fs.fsync_file
        monkeypatch.setattr(
            _fs,
            "fsync_file",
            lambda fd: (syncers.append(threading.current_thread().name), real_fsync(fd)),
        )

        async def main():
            return [await log.append_async(b"a%d" % i) for i in range(3)]

        assert asyncio.run(main()) == [1, 2, 3]
        loop_thread = threading.current_thread().name
        assert writers == [loop_thread] * 3
        assert len(syncers) == 3 and loop_thread not in syncers
        assert log._group._flusher is None  # no thread hop through a flusher
        assert log.last_seq == 3


def test_fsyncs_overlap_up_to_max_syncs(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        gate = GatedFsync(monkeypatch)
        gate.open.clear()
        threads = [threading.Thread(target=log.append, args=(b"r%d" % i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        # every fsync is held: batches are written until 4 are in flight, then they queue
        wait_for(lambda: len(gate.calls) == 4)
        group = log._group
        wait_for(lambda: sum(len(b.waiters) for b in group._inflight) + len(group._queue) == 12)
        time.sleep(0.05)
        assert len(group._inflight) == 4
        assert len(gate.calls) == 4
        assert log.last_seq == 0  # nothing is acknowledged while every fsync is held
        gate.open.set()
        for thread in threads:
            thread.join()
        assert log.last_seq == 12


def test_append_async_leaves_the_event_loop_free_during_the_fsync(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        gate = GatedFsync(monkeypatch)
        gate.open.clear()
        ticks = []

        async def ticker():
            while True:
                ticks.append(None)
                await asyncio.sleep(0.001)

        async def main():
            tick_task = asyncio.create_task(ticker())
            append_task = asyncio.create_task(log.append_async(b"async"))
            while not gate.entered.is_set():
                await asyncio.sleep(0.001)
            before = len(ticks)
            await asyncio.sleep(0.05)
            assert not append_task.done()
            assert len(ticks) > before  # the loop kept running while the fsync was held
            gate.open.set()
            seq = await append_task
            tick_task.cancel()
            return seq

        assert asyncio.run(main()) == 1
        assert list(log.records()) == [Record(1, b"async")]


def test_a_cancelled_append_async_still_commits_its_record(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        gate = GatedFsync(monkeypatch)
        gate.open.clear()

        async def main():
            task = asyncio.create_task(log.append_async(b"kept"))
            while not gate.entered.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.open.set()
            return await log.append_async(b"next")

        assert asyncio.run(main()) == 2
        assert list(log.records()) == [Record(1, b"kept"), Record(2, b"next")]


def test_close_waits_for_queued_records_and_makes_them_durable(tmp_path, monkeypatch):
    log = FileLog(tmp_path)
    gate = GatedWrite(monkeypatch)
    appenders = [threading.Thread(target=log.append, args=(b"r%d" % i,)) for i in range(3)]
    appenders[0].start()
    assert gate.entered.wait(timeout=30)
    for thread in appenders[1:]:
        thread.start()
    wait_for(lambda: len(log._group._queue) == 2)
    closer = threading.Thread(target=log.close)
    closer.start()
    wait_for(lambda: len(log._group._queue) == 3)  # close queued its barrier behind them
    assert closer.is_alive()
    gate.open.set()
    for thread in [*appenders, closer]:
        thread.join()
    with pytest.raises(WalClosedError):
        log.append(b"late")
    with FileLog(tmp_path) as reopened:
        assert sorted(r.payload for r in reopened.records()) == [b"r0", b"r1", b"r2"]


def failing_fsync(monkeypatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fs, "fsync_file", fsync)


def test_a_failed_fsync_fails_the_append_and_poisons_the_log(tmp_path, monkeypatch):
    log = FileLog(tmp_path)
    log.append(b"durable")
    failing_fsync(monkeypatch)
    segment = tmp_path / "seg-00000000000000000001.wal"
    with pytest.raises(WalIOError) as info:
        log.append(b"lost?")
    assert str(info.value) == f"fsync of {segment} failed: [Errno 5] Input/output error"
    monkeypatch.undo()
    with pytest.raises(WalIOError) as info:
        log.append(b"refused")
    assert str(info.value) == (
        f"fsync of {segment} failed: [Errno 5] Input/output error; the log refuses appends "
        "until it is reopened"
    )
    with pytest.raises(WalIOError):
        log.write_snapshot(b"s")
    log.close()
    with FileLog(tmp_path) as reopened:  # reopening is the way back
        # the record whose fsync failed reached the page cache, so this kernel shows it
        assert [r.payload for r in reopened.records()] == [b"durable", b"lost?"]
        assert reopened.append(b"again") == 3


def test_a_failed_fsync_fails_the_async_waiters_too(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        failing_fsync(monkeypatch)

        async def main():
            return await asyncio.gather(
                *(log.append_async(b"a%d" % i) for i in range(3)), return_exceptions=True
            )

        results = asyncio.run(main())
        assert [type(r) for r in results] == [WalIOError] * 3


def test_a_failed_fsync_fails_an_append_many_async(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        failing_fsync(monkeypatch)
        with pytest.raises(WalIOError):
            asyncio.run(log.append_many_async([b"committed", b"prepared"]))
        with pytest.raises(WalIOError):  # the log refuses appends until it is reopened
            log.append(b"after")


def test_a_failed_write_poisons_the_log_and_open_truncates_the_partial_record(
    tmp_path, monkeypatch
):
    log = FileLog(tmp_path)
    log.append(b"good")
    real_write = _fs.write_all

    def half_then_enospc(fd: int, data: bytes) -> None:
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_fs, "write_all", half_then_enospc)
    with pytest.raises(WalIOError) as info:
        log.append(b"half written")
    segment = tmp_path / "seg-00000000000000000001.wal"
    assert str(info.value) == (
        f"writing seq 2..3 to {segment} failed: [Errno 28] No space left on device"
    )
    monkeypatch.undo()
    with pytest.raises(WalIOError):
        log.append(b"refused")
    log.close()
    with FileLog(tmp_path) as reopened:
        assert reopened.recovery.torn_tail.offset == 24 + 24
        assert reopened.recovery.torn_tail.dropped_bytes == 16
        assert list(reopened.records()) == [Record(1, b"good")]


def test_a_failed_rollover_poisons_the_log(tmp_path, monkeypatch):
    log = FileLog(tmp_path, segment_bytes=64)
    log.append(b"x" * 40)  # 24 + 60 bytes: the next append rolls over

    def no_create(path, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(_fs, "atomic_write", no_create)
    with pytest.raises(WalIOError) as info:
        log.append(b"y")
    assert "Read-only file system" in str(info.value)
    with pytest.raises(WalIOError):
        log.append(b"z")
    monkeypatch.undo()
    log.close()
    with FileLog(tmp_path, segment_bytes=64) as reopened:
        assert list(reopened.records()) == [Record(1, b"x" * 40)]


def test_a_failed_snapshot_write_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        log.append(b"a")
        log.write_snapshot(b"one")
        log.append(b"b")

        def no_write(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_fs, "atomic_write", no_write)
        with pytest.raises(WalIOError) as info:
            log.write_snapshot(b"two")
        assert str(info.value) == (
            f"writing snapshot 2 in {tmp_path} failed: [Errno 28] No space left on device"
        )
        assert log.latest_snapshot().data == b"one"
        assert log.append(b"c") == 3  # a failed snapshot does not poison appends


def test_a_bug_in_the_write_function_fails_the_batch_as_an_io_error():
    def write(payloads):
        raise ValueError("bug")

    group = GroupCommit(write, lambda ticket: None, lambda seq: None, "test")
    with pytest.raises(WalIOError) as info:
        group.commit(b"a")
    assert str(info.value) == "write to test raised ValueError('bug')"
    assert group.failed == (
        "write to test raised ValueError('bug'); the log refuses appends until it is reopened"
    )
    group.close()


def test_a_bug_in_the_sync_function_fails_the_batch_as_an_io_error():
    def sync(ticket):
        raise RuntimeError("bug")

    group = GroupCommit(lambda payloads: (1, "ticket"), sync, lambda seq: None, "test")
    with pytest.raises(WalIOError) as info:
        group.commit(b"a")
    assert str(info.value) == "fsync of test raised RuntimeError('bug')"
    group.close()


def test_threads_and_two_event_loops_appending_at_once_share_one_sequence(tmp_path):
    results: dict[int, bytes] = {}
    lock = threading.Lock()

    def keep(seq: int, payload: bytes) -> None:
        with lock:
            assert seq not in results
            results[seq] = payload

    with FileLog(tmp_path, segment_bytes=2048) as log:

        def sync_appender(t: int) -> None:
            for i in range(30):
                payload = b"sync %d %d" % (t, i)
                keep(log.append(payload), payload)

        def loop_appender(loop_id: int) -> None:
            async def one(i: int) -> None:
                payload = b"async %d %d" % (loop_id, i)
                keep(await log.append_async(payload), payload)

            async def main() -> None:
                await asyncio.gather(*(one(i) for i in range(60)))

            asyncio.run(main())

        threads = [threading.Thread(target=sync_appender, args=(t,)) for t in range(4)]
        threads += [threading.Thread(target=loop_appender, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert sorted(results) == list(range(1, 241))
        assert {r.seq: r.payload for r in log.records()} == results
        assert log._group.batches < 240


def test_an_append_async_whose_event_loop_closed_does_not_break_the_log(tmp_path, monkeypatch):
    with FileLog(tmp_path) as log:
        gate = GatedFsync(monkeypatch)
        gate.open.clear()
        loop = asyncio.new_event_loop()
        task = loop.create_task(log.append_async(b"orphan"))
        while not gate.entered.is_set():
            loop.run_until_complete(asyncio.sleep(0.001))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(task)
        loop.close()  # settling the orphan's future now raises in call_soon_threadsafe
        gate.open.set()
        assert log.append(b"next") == 2
        assert [r.payload for r in log.records()] == [b"orphan", b"next"]


def test_a_failed_write_poisons_the_log_before_the_next_batch_is_written():
    """Regression: the failure of a write was recorded only once its batch was finished (in
    the fsync pool, or after the writer role was handed on), so the flusher could write the
    next batch behind the torn bytes, reusing their sequence numbers; the log then refused
    to open. Now the write's own failure poisons the log before the role moves on."""
    from wal.group import _Waiter

    writes = []

    def write(payloads):
        writes.append(payloads)
        raise WalIOError("writing seq 1..1 failed: [Errno 28] No space left on device")

    group = GroupCommit(write, lambda ticket: None, lambda seq: None, "test")
    group._queue.append(_Waiter(b"a", None))
    group._leading = True  # the writer role, as `_enqueue` gives it
    batch = group._write_batch()  # the write fails; its fsync has not run
    assert batch.error is not None
    assert group.failed == (
        "writing seq 1..1 failed: [Errno 28] No space left on device; the log refuses "
        "appends until it is reopened"
    )
    group._queue.append(_Waiter(b"b", None))
    group._write_batch()  # what the flusher would write next
    assert writes == [[b"a"]]  # nothing written behind the failure


class TwoBatches:
    """A group commit over fakes whose batch "a" (seq 1) and batch "b" (seq 2) each hold
    their fsync until let go: `entered[n]` once fsync n is in progress, `gates[n]` lets it
    return (fsync 2 raising EIO when `second_fails`)."""

    def __init__(self, second_fails: bool) -> None:
        self.gates = {1: threading.Event(), 2: threading.Event()}
        self.entered = {1: threading.Event(), 2: threading.Event()}
        self.second_fails = second_fails
        self.durable: list[int] = []
        self.outcome: dict[str, object] = {}
        self.group = GroupCommit(self._write, self._sync, self.durable.append, "test")

    @staticmethod
    def _write(payloads):
        first = 1 if payloads == [b"a"] else 2
        return first, first

    def _sync(self, ticket):
        self.entered[ticket].set()
        assert self.gates[ticket].wait(10)
        if ticket == 2 and self.second_fails:
            raise WalIOError("fsync of seg-1 failed: [Errno 5] Input/output error")

    def append(self, name: str) -> threading.Thread:
        def run():
            try:
                self.outcome[name] = self.group.commit(name.encode())
            except WalIOError as exc:
                self.outcome[name] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    def overlapping(self) -> tuple[threading.Thread, threading.Thread]:
        """Batch a's fsync in progress (a gave up the writer role), then b's beside it."""
        a = self.append("a")
        assert self.entered[1].wait(10)
        b = self.append("b")
        assert self.entered[2].wait(10)
        return a, b


def test_a_batch_whose_fsync_error_another_fsync_took_is_not_acknowledged():
    """Linux reports a writeback error to one fsync of the file: batch A's fsync may return
    0 while an overlapping fsync (batch B's) reports A's lost pages. Regression: A was
    acknowledged as soon as its own fsync returned. Now A waits for the fsyncs in progress
    when its own returned, and fails with B's error."""
    two = TwoBatches(second_fails=True)
    a, b = two.overlapping()
    two.gates[1].set()  # A's fsync returns 0
    a.join(0.3)
    assert a.is_alive() and "a" not in two.outcome  # not acknowledged while B's runs
    two.gates[2].set()  # B's fsync reports the error
    a.join(10)
    b.join(10)
    assert isinstance(two.outcome["a"], WalIOError) and isinstance(two.outcome["b"], WalIOError)
    assert "Input/output error" in str(two.outcome["a"])
    two.group.close()


def test_overlapping_fsyncs_that_succeed_acknowledge_both_in_order():
    two = TwoBatches(second_fails=False)
    a, b = two.overlapping()
    two.gates[1].set()
    a.join(0.3)
    assert a.is_alive()  # waits for B's fsync, which overlapped its own
    two.gates[2].set()
    a.join(10)
    b.join(10)
    assert two.outcome == {"a": 1, "b": 2} and two.durable == [1, 2]
    two.group.close()
