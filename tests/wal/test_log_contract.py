"""The CommitLog contract, run against MemoryLog and FileLog (the `log_env` fixture)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from wal import CommitLog, Record, RecoveryReport, Snapshot
from wal.errors import WalClosedError, WalLockedError, WalUsageError


def test_both_implementations_satisfy_the_protocol(log_env):
    log = log_env.open()
    assert isinstance(log, CommitLog)


def test_an_empty_log(log_env):
    log = log_env.open()
    assert (log.first_seq, log.last_seq) == (1, 0)
    assert list(log.records()) == []
    assert log.latest_snapshot() is None
    assert log.recovery == RecoveryReport(
        snapshot_seq=0, last_seq=0, segments_scanned=0, records_scanned=0, torn_tail=None
    )


def test_append_numbers_records_from_one_and_reads_them_back(log_env):
    log = log_env.open()
    assert [log.append(p) for p in (b"a", b"", b"c" * 1000)] == [1, 2, 3]
    assert log.last_seq == 3
    assert list(log.records()) == [Record(1, b"a"), Record(2, b""), Record(3, b"c" * 1000)]
    assert list(log.records(3)) == [Record(3, b"c" * 1000)]
    assert list(log.records(4)) == []


def test_append_many_numbers_its_records_consecutively_in_order(log_env):
    log = log_env.open(max_record_bytes=10)
    assert log.append(b"a") == 1
    assert log.append_many([b"b", b"", b"c" * 10]) == [2, 3, 4]
    assert log.append_many([]) == []
    assert [r.payload for r in log.records()] == [b"a", b"b", b"", b"c" * 10]
    with pytest.raises(WalUsageError):  # one oversized payload: none of them is written
        log.append_many([b"d", b"x" * 11])
    assert log.last_seq == 4 and log.append(b"e") == 5


def test_bytearray_and_memoryview_are_stored_as_bytes(log_env):
    log = log_env.open()
    log.append(bytearray(b"ba"))
    log.append(memoryview(b"mv"))
    assert list(log.records()) == [Record(1, b"ba"), Record(2, b"mv")]
    assert all(type(r.payload) is bytes for r in log.records())


def test_a_payload_that_is_not_bytes_is_refused(log_env):
    log = log_env.open()
    with pytest.raises(WalUsageError) as info:
        log.append("text")
    assert str(info.value) == "payload must be bytes, got str"
    assert log.last_seq == 0


def test_an_oversized_payload_is_refused_and_nothing_is_written(log_env):
    log = log_env.open(max_record_bytes=10)
    assert log.append(b"x" * 10) == 1
    with pytest.raises(WalUsageError) as info:
        log.append(b"x" * 11)
    assert str(info.value) == "payload is 11 bytes; this log takes at most 10"
    assert log.append(b"y") == 2


def test_records_survive_close_and_reopen_and_appends_continue(log_env):
    log = log_env.open()
    for i in range(5):
        log.append(b"r%d" % i)
    log.close()
    log = log_env.open()
    assert log.recovery.last_seq == 5
    assert log.recovery.records_scanned == 5
    assert log.append(b"r5") == 6
    assert [r.payload for r in log.records()] == [b"r%d" % i for i in range(6)]


def test_a_second_open_of_the_same_log_is_refused(log_env):
    log_env.open()
    with pytest.raises(WalLockedError):
        log_env.open()


def test_after_close_appends_reads_and_snapshots_are_refused(log_env):
    log = log_env.open()
    log.append(b"a")
    log.close()
    log.close()  # idempotent
    with pytest.raises(WalClosedError):
        log.append(b"b")
    with pytest.raises(WalClosedError):
        log.records()
    with pytest.raises(WalClosedError):
        log.write_snapshot(b"s")
    with pytest.raises(WalClosedError):
        asyncio.run(log.append_async(b"c"))


def test_append_async_from_many_tasks_numbers_every_record_once(log_env):
    log = log_env.open()
    payloads = [b"task %d" % i for i in range(50)]

    async def main():
        return await asyncio.gather(*(log.append_async(p) for p in payloads))

    seqs = asyncio.run(main())
    assert sorted(seqs) == list(range(1, 51))
    stored = {r.seq: r.payload for r in log.records()}
    assert {seq: stored[seq] for seq in seqs} == dict(zip(seqs, payloads, strict=True))


def test_append_many_async_numbers_its_records_consecutively_among_other_tasks(log_env):
    log = log_env.open()

    async def main():
        return await asyncio.gather(
            log.append_async(b"alone"),
            log.append_many_async([b"c0", b"p1"]),
            log.append_many_async([b"c1", b"p2", b"d"]),
            log.append_many_async([]),
        )

    alone, pair, triple, none = asyncio.run(main())
    assert none == []
    assert pair[1] == pair[0] + 1 and triple == [triple[0], triple[0] + 1, triple[0] + 2]
    assert sorted([alone, *pair, *triple]) == list(range(1, 7))
    stored = {r.seq: r.payload for r in log.records()}
    assert [stored[s] for s in pair] == [b"c0", b"p1"]
    assert [stored[s] for s in triple] == [b"c1", b"p2", b"d"]


def test_append_many_async_refuses_an_oversized_record_and_writes_none(log_env):
    log = log_env.open(max_record_bytes=10)
    with pytest.raises(WalUsageError):
        asyncio.run(log.append_many_async([b"ok", b"x" * 11]))
    assert log.last_seq == 0 and list(log.records()) == []


def test_threads_appending_concurrently_get_unique_contiguous_seqs(log_env):
    log = log_env.open()
    results: dict[int, bytes] = {}
    lock = threading.Lock()

    def appender(t: int) -> None:
        for i in range(40):
            payload = b"thread %d item %d" % (t, i)
            seq = log.append(payload)
            with lock:
                results[seq] = payload

    threads = [threading.Thread(target=appender, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(1, 321))
    assert {r.seq: r.payload for r in log.records()} == results


def test_snapshot_defaults_to_the_last_seq_and_survives_reopen(log_env):
    log = log_env.open()
    for i in range(3):
        log.append(b"%d" % i)
    assert log.write_snapshot(b"state") == Snapshot(3, b"state")
    assert log.latest_snapshot() == Snapshot(3, b"state")
    log.append(b"after")
    log.close()
    log = log_env.open()
    assert log.latest_snapshot() == Snapshot(3, b"state")
    assert log.recovery.snapshot_seq == 3
    assert list(log.records(4)) == [Record(4, b"after")]


def test_a_snapshot_at_an_explicit_earlier_seq(log_env):
    log = log_env.open()
    for i in range(5):
        log.append(b"%d" % i)
    assert log.write_snapshot(b"two", seq=2) == Snapshot(2, b"two")
    assert [r.seq for r in log.records(3)] == [3, 4, 5]


def test_a_snapshot_beyond_the_last_durable_seq_is_refused(log_env):
    log = log_env.open()
    log.append(b"a")
    with pytest.raises(WalUsageError) as info:
        log.write_snapshot(b"s", seq=2)
    assert str(info.value) == (
        "snapshot seq must be in 0..1 (latest snapshot..last durable seq), got 2"
    )
    assert log.latest_snapshot() is None


def test_a_snapshot_older_than_the_latest_is_refused(log_env):
    log = log_env.open()
    for _ in range(4):
        log.append(b"a")
    log.write_snapshot(b"s3", seq=3)
    with pytest.raises(WalUsageError) as info:
        log.write_snapshot(b"s2", seq=2)
    assert str(info.value) == (
        "snapshot seq must be in 3..4 (latest snapshot..last durable seq), got 2"
    )
    assert log.latest_snapshot() == Snapshot(3, b"s3")


def test_a_snapshot_at_the_same_seq_replaces_the_latest(log_env):
    log = log_env.open()
    log.append(b"a")
    log.write_snapshot(b"first")
    log.write_snapshot(b"second")
    assert log.latest_snapshot() == Snapshot(1, b"second")
    log.close()
    assert log_env.open().latest_snapshot() == Snapshot(1, b"second")


def test_snapshot_data_must_be_bytes(log_env):
    log = log_env.open()
    with pytest.raises(WalUsageError) as info:
        log.write_snapshot({"state": 1})
    assert str(info.value) == "payload must be bytes, got dict"


def test_records_the_kept_snapshots_cover_may_be_dropped_and_reading_them_is_refused(log_env):
    log = log_env.open(keep_snapshots=1, segment_bytes=64)
    for i in range(20):
        log.append(b"record %d" % i)
    log.write_snapshot(b"s", seq=15)
    # everything after the snapshot stays readable; what it covers may be gone
    first = log.first_seq
    assert 1 < first <= 16
    assert [r.seq for r in log.records(first)] == list(range(first, 21))
    with pytest.raises(WalUsageError) as info:
        log.records(first - 1)
    assert str(info.value) == (
        f"records before seq {first} were dropped after a snapshot; asked for seq "
        f"{first - 1} (read latest_snapshot() and then records({first}))"
    )


def test_keep_snapshots_2_keeps_the_records_after_the_previous_snapshot(log_env):
    log = log_env.open(keep_snapshots=2, segment_bytes=64)
    for i in range(30):
        log.append(b"record %d" % i)
    log.write_snapshot(b"s10", seq=10)
    log.write_snapshot(b"s25", seq=25)
    assert log.first_seq <= 11
    assert [r.seq for r in log.records(11)] == list(range(11, 31))


def test_invalid_keep_snapshots_is_refused(log_env):
    with pytest.raises(WalUsageError) as info:
        log_env.open(keep_snapshots=0)
    assert str(info.value) == "keep_snapshots must be >= 1, got 0"
