"""FileLog on disk: the format, rollover, snapshots and what open does with damage."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import pytest

from wal import FileLog, Record, Snapshot, TornTail
from wal.errors import WalCorruptionError, WalUsageError, WalVersionError
from wal.segment import encode_record, encode_segment_header, encode_snapshot

SEG1 = "seg-00000000000000000001.wal"


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "LOCK")


def write_log(directory: Path, payloads: list[bytes], **options) -> None:
    with FileLog(directory, **options) as log:
        for payload in payloads:
            log.append(payload)


def refusal(directory: Path, name: str, offset: int, reason: str) -> str:
    return (
        f"{directory / name}: corrupt at byte offset {offset}: {reason}. The log refuses to "
        f"open; run `muser wal repair {directory}` to keep every record before this point "
        f"and move the rest into {directory / 'quarantine'}/"
    )


def test_the_bytes_on_disk_are_exactly_the_drawn_format(tmp_path):
    write_log(tmp_path, [b"hello", b""])
    data = (tmp_path / SEG1).read_bytes()
    header = b"MUSERWAL" + struct.pack("<IQ", 1, 1)
    header += struct.pack("<I", crc32c.crc32c(header))
    body = struct.pack("<IQ", 5, 1) + b"hello"
    rec1 = b"\xa5WR\x5a" + struct.pack("<I", crc32c.crc32c(body)) + body
    body2 = struct.pack("<IQ", 0, 2)
    rec2 = b"\xa5WR\x5a" + struct.pack("<I", crc32c.crc32c(body2)) + body2
    assert data == header + rec1 + rec2
    assert len(header) == 24 and len(rec1) == 25 and len(rec2) == 20


def test_segments_roll_over_at_the_configured_size(tmp_path):
    # 24-byte header + 70-byte records: after 3 records a segment holds 234 >= 200 bytes
    write_log(tmp_path, [b"p" * 50] * 10, segment_bytes=200)
    assert files(tmp_path) == [
        "seg-00000000000000000001.wal",
        "seg-00000000000000000004.wal",
        "seg-00000000000000000007.wal",
        "seg-00000000000000000010.wal",
    ]
    assert [(tmp_path / f).stat().st_size for f in files(tmp_path)] == [234, 234, 234, 94]
    with FileLog(tmp_path, segment_bytes=200) as log:
        assert [r.seq for r in log.records()] == list(range(1, 11))
        assert log.append(b"p" * 50) == 11
    assert (tmp_path / "seg-00000000000000000010.wal").stat().st_size == 164


def test_a_record_larger_than_a_segment_is_written_whole_then_the_segment_rolls(tmp_path):
    write_log(tmp_path, [b"a", b"b" * 500, b"c"], segment_bytes=100)
    assert files(tmp_path) == [SEG1, "seg-00000000000000000003.wal"]
    assert (tmp_path / SEG1).stat().st_size == 24 + 21 + 520


def test_invalid_segment_and_record_limits_are_refused(tmp_path):
    with pytest.raises(WalUsageError) as info:
        FileLog(tmp_path, segment_bytes=63)
    assert str(info.value) == "segment_bytes must be >= 64, got 63"
    with pytest.raises(WalUsageError) as info:
        FileLog(tmp_path, max_record_bytes=0)
    assert str(info.value) == "max_record_bytes must be in 1..1073741824, got 0"


def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(WalUsageError) as info:
        FileLog(tmp_path / "file")
    assert str(info.value) == f"{tmp_path / 'file'} exists and is not a directory"


def test_a_missing_directory_is_created(tmp_path):
    with FileLog(tmp_path / "a" / "b") as log:
        assert log.append(b"x") == 1
    assert files(tmp_path / "a" / "b") == [SEG1]


def test_open_reads_only_the_segments_after_the_latest_snapshot(tmp_path):
    with FileLog(tmp_path, segment_bytes=200) as log:
        for _ in range(30):
            log.append(b"p" * 50)  # 3 records per segment: seq 1-3, 4-6, ..., 28-30
        log.write_snapshot(b"state", seq=25)
        log.append(b"p" * 50)
    with FileLog(tmp_path, segment_bytes=200) as log:
        # the segment holding seq 26 (25..27), 28..30 and the one with 31
        assert log.recovery.segments_scanned == 3
        assert log.recovery.records_scanned == 7
        assert log.recovery.snapshot_seq == 25
        assert log.latest_snapshot() == Snapshot(25, b"state")


def test_snapshots_drop_segments_no_kept_snapshot_needs(tmp_path):
    with FileLog(tmp_path, segment_bytes=200, keep_snapshots=2) as log:
        for _ in range(30):
            log.append(b"p" * 50)
        log.write_snapshot(b"a", seq=10)
        # the only kept snapshot covers 1..10: segments 1-3, 4-6, 7-9 go
        assert files(tmp_path)[:2] == [
            "seg-00000000000000000010.wal",
            "seg-00000000000000000013.wal",
        ]
        log.write_snapshot(b"b", seq=20)
        # two kept snapshots, the older at 10: nothing more can go
        assert files(tmp_path)[0] == "seg-00000000000000000010.wal"
        log.write_snapshot(b"c", seq=29)
        # kept: 20 and 29; segments wholly at or below 20 go, snapshot 10 goes
        assert files(tmp_path) == [
            "seg-00000000000000000019.wal",
            "seg-00000000000000000022.wal",
            "seg-00000000000000000025.wal",
            "seg-00000000000000000028.wal",
            "snap-00000000000000000020.snap",
            "snap-00000000000000000029.snap",
        ]
        assert log.first_seq == 19


def test_the_active_segment_is_never_dropped(tmp_path):
    with FileLog(tmp_path, keep_snapshots=1) as log:
        log.append(b"a")
        log.write_snapshot(b"s")
        assert files(tmp_path) == [SEG1, "snap-00000000000000000001.snap"]
    with FileLog(tmp_path) as log:
        assert log.append(b"b") == 2


def test_leftover_temp_files_of_a_crashed_create_are_removed_at_open(tmp_path):
    write_log(tmp_path, [b"a"])
    (tmp_path / "seg-00000000000000000002.wal.tmp").write_bytes(b"MUSER")
    (tmp_path / "snap-00000000000000000001.snap.tmp").write_bytes(b"MUS")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    with FileLog(tmp_path) as log:
        assert log.last_seq == 1
    assert files(tmp_path) == ["notes.tmp", SEG1]


# ---- torn tails -------------------------------------------------------------------------


def torn_case(tmp_path: Path, tail: bytes) -> tuple[FileLog, int]:
    write_log(tmp_path, [b"one", b"two"])
    path = tmp_path / SEG1
    good = path.stat().st_size
    with path.open("ab") as handle:
        handle.write(tail)
    return FileLog(tmp_path), good


@pytest.mark.parametrize(
    ("tail", "reason"),
    [
        (encode_record(3, b"three")[:7], "partial record header (7 of 20 bytes)"),
        (
            encode_record(3, b"three")[:22],
            "record length 5 runs past the end of the file (22 bytes left)",
        ),
        (
            encode_record(3, b"three")[:-1] + b"X",
            "record checksum mismatch (stored {stored}, computed {computed})",
        ),
        (b"\0" * 4096, "record marker b'\\x00\\x00\\x00\\x00', expected b'\\xa5WRZ'"),
    ],
    ids=["partial-header", "short-payload", "bad-checksum", "zero-fill"],
)
def test_a_torn_tail_is_truncated_and_reported(tmp_path, tail, reason):
    if "{stored}" in reason:
        reason = checksum_reason(tail)
    log, good = torn_case(tmp_path, tail)
    with log:
        assert log.recovery.torn_tail == TornTail(SEG1, good, len(tail), reason)
        assert list(log.records()) == [Record(1, b"one"), Record(2, b"two")]
        assert (tmp_path / SEG1).stat().st_size == good
        assert log.append(b"three") == 3
    with FileLog(tmp_path) as log:
        assert log.recovery.torn_tail is None
        assert [r.payload for r in log.records()] == [b"one", b"two", b"three"]


# ---- corruption -------------------------------------------------------------------------


def checksum_reason(record: bytes) -> str:
    """The reason open gives for `record` when its stored checksum does not match."""
    (stored,) = struct.unpack_from("<I", record, 4)
    computed = crc32c.crc32c(record[8:])
    return f"record checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_bad_record_followed_by_a_good_one_refuses_open(tmp_path):
    write_log(tmp_path, [b"one", b"two", b"three"])
    flip(tmp_path / SEG1, 24 + 23 + 20)  # first payload byte of record 2 (at 47)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    damaged = bytearray(encode_record(2, b"two"))
    damaged[20] ^= 0x01
    reason = checksum_reason(bytes(damaged)) + "; a good record follows at byte offset 70"
    assert str(info.value) == refusal(tmp_path, SEG1, 47, reason)
    assert (info.value.path, info.value.offset) == (tmp_path / SEG1, 47)
    assert info.value.exit_code == 2


def test_damage_in_a_sealed_segment_refuses_open_even_at_its_end(tmp_path):
    write_log(tmp_path, [b"p" * 50] * 4, segment_bytes=200)
    seg = tmp_path / SEG1
    with seg.open("r+b") as handle:
        handle.truncate(seg.stat().st_size - 3)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path, segment_bytes=200)
    assert str(info.value) == refusal(
        tmp_path, SEG1, 164, "record length 50 runs past the end of the file (67 bytes left)"
    )


def test_a_bad_segment_header_refuses_open(tmp_path):
    write_log(tmp_path, [b"a"])
    flip(tmp_path / SEG1, 3)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert str(info.value) == refusal(
        tmp_path, SEG1, 0, "segment header magic b'MUSDRWAL', expected b'MUSERWAL'"
    )


def test_a_segment_header_whose_checksum_fails_refuses_open(tmp_path):
    write_log(tmp_path, [b"a"])
    flip(tmp_path / SEG1, 12)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert info.value.reason == "segment header checksum mismatch"


def test_a_truncated_segment_header_refuses_open(tmp_path):
    (tmp_path / SEG1).write_bytes(encode_segment_header(1)[:10])
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert info.value.reason == "segment header truncated (10 of 24 bytes)"


def test_a_segment_whose_header_disagrees_with_its_name_refuses_open(tmp_path):
    (tmp_path / SEG1).write_bytes(encode_segment_header(7))
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert info.value.reason == "segment header says first seq 7 but the file name says 1"


def test_a_newer_format_version_is_refused_not_called_corrupt(tmp_path):
    head = b"MUSERWAL" + struct.pack("<IQ", 2, 1)
    (tmp_path / SEG1).write_bytes(head + struct.pack("<I", crc32c.crc32c(head)))
    with pytest.raises(WalVersionError) as info:
        FileLog(tmp_path)
    assert str(info.value) == (
        f"{SEG1} has format version 2; this build reads version 1 only. Open it with the "
        "build that wrote it."
    )


def test_a_gap_between_segments_refuses_open(tmp_path):
    write_log(tmp_path, [b"p" * 50] * 7, segment_bytes=200)
    (tmp_path / "seg-00000000000000000004.wal").unlink()
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path, segment_bytes=200)
    assert str(info.value) == refusal(
        tmp_path,
        "seg-00000000000000000007.wal",
        0,
        "segment starts at seq 7 but the previous segment ends at seq 3",
    )


def test_a_record_with_the_wrong_seq_refuses_open(tmp_path):
    write_log(tmp_path, [b"a"])
    with (tmp_path / SEG1).open("ab") as handle:
        handle.write(encode_record(5, b"stray"))
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert info.value.reason == "record has seq 5 where 2 was expected"
    assert info.value.offset == 45


def test_missing_first_records_without_a_snapshot_refuse_open(tmp_path):
    write_log(tmp_path, [b"p" * 50] * 7, segment_bytes=200)
    (tmp_path / SEG1).unlink()
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path, segment_bytes=200)
    assert info.value.reason == (
        "records 1..3 are missing (no snapshot covers them; this segment starts at seq 4)"
    )


def test_a_bad_latest_snapshot_refuses_open(tmp_path):
    with FileLog(tmp_path) as log:
        log.append(b"a")
        log.write_snapshot(b"state")
    snap = tmp_path / "snap-00000000000000000001.snap"
    flip(snap, 34)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert (info.value.path, info.value.offset) == (snap, 0)
    assert info.value.reason.startswith("snapshot checksum mismatch")


@pytest.mark.parametrize(
    ("raw", "offset", "reason"),
    [
        (encode_snapshot(1, b"s")[:20], 20, "snapshot header truncated (20 of 32 bytes)"),
        (
            b"NOTASNAP" + encode_snapshot(1, b"s")[8:],
            0,
            "snapshot magic b'NOTASNAP', expected b'MUSERSNP'",
        ),
        (encode_snapshot(1, b"state")[:-1], 32, "snapshot holds 4 data bytes, header says 5"),
        (encode_snapshot(9, b"s"), 0, "snapshot header says seq 9 but the file name says 1"),
    ],
    ids=["truncated", "magic", "length", "seq"],
)
def test_each_kind_of_bad_snapshot_is_named(tmp_path, raw, offset, reason):
    write_log(tmp_path, [b"a"])
    (tmp_path / "snap-00000000000000000001.snap").write_bytes(raw)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert (info.value.offset, info.value.reason) == (offset, reason)


def test_a_snapshot_beyond_the_end_of_the_log_refuses_open(tmp_path):
    write_log(tmp_path, [b"a", b"b"])
    (tmp_path / "snap-00000000000000000005.snap").write_bytes(encode_snapshot(5, b"s"))
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path)
    assert info.value.path.name == "snap-00000000000000000005.snap"
    assert info.value.reason == "snapshot covers up to seq 5 but the log ends at seq 2"


def test_damage_before_the_snapshot_is_found_when_those_records_are_read(tmp_path):
    with FileLog(tmp_path, segment_bytes=200, keep_snapshots=2) as log:
        for _ in range(9):
            log.append(b"p" * 50)
        log.write_snapshot(b"a", seq=1)
        log.write_snapshot(b"b", seq=8)
    flip(tmp_path / "seg-00000000000000000004.wal", 24 + 30)
    with FileLog(tmp_path, segment_bytes=200) as log:  # open reads from seq 9 only
        assert log.recovery.segments_scanned == 1
        records = log.records(2)
        assert [next(records).seq for _ in range(2)] == [2, 3]
        with pytest.raises(WalCorruptionError) as info:
            next(records)
        assert (info.value.path.name, info.value.offset) == ("seg-00000000000000000004.wal", 24)


def test_a_segment_dropped_while_records_are_read_is_reported(tmp_path):
    with FileLog(tmp_path, segment_bytes=200, keep_snapshots=1) as log:
        for _ in range(9):
            log.append(b"p" * 50)
        records = log.records(1)
        assert next(records).seq == 1
        log.write_snapshot(b"s", seq=8)
        assert [next(records).seq for _ in range(2)] == [2, 3]
        with pytest.raises(WalUsageError) as info:
            next(records)
        assert str(info.value) == (
            "seg-00000000000000000004.wal was dropped by a snapshot while records() was reading it"
        )


def test_appends_survive_many_reopen_cycles_byte_for_byte(tmp_path):
    expected = []
    for cycle in range(5):
        with FileLog(tmp_path, segment_bytes=300) as log:
            for i in range(7):
                payload = os.urandom(cycle * 13 + i)
                expected.append(payload)
                assert log.append(payload) == len(expected)
    with FileLog(tmp_path, segment_bytes=300) as log:
        assert [r.payload for r in log.records()] == expected


def test_a_snapshot_in_a_newer_format_version_is_refused(tmp_path):
    write_log(tmp_path, [b"a"])
    head = struct.pack("<IQQ", 2, 1, 1)
    raw = b"MUSERSNP" + head + struct.pack("<I", crc32c.crc32c(b"s", crc32c.crc32c(head))) + b"s"
    (tmp_path / "snap-00000000000000000001.snap").write_bytes(raw)
    with pytest.raises(WalVersionError) as info:
        FileLog(tmp_path)
    assert str(info.value).startswith("snap-00000000000000000001.snap has format version 2;")


def test_a_bad_header_of_a_segment_the_snapshot_covers_still_refuses_open(tmp_path):
    with FileLog(tmp_path, segment_bytes=200, keep_snapshots=2) as log:
        for _ in range(9):
            log.append(b"p" * 50)
        log.write_snapshot(b"a", seq=1)
        log.write_snapshot(b"b", seq=8)
    flip(tmp_path / "seg-00000000000000000004.wal", 0)
    with pytest.raises(WalCorruptionError) as info:
        FileLog(tmp_path, segment_bytes=200)
    assert (info.value.path.name, info.value.offset) == ("seg-00000000000000000004.wal", 0)
