"""`repair_log` around the latest snapshot: damage the snapshot covers costs neither the
snapshot nor any record after it; damage after it keeps cutting the log there; and repair
refuses, rather than quarantine a good snapshot, a cut that would end the log before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from wal import FileLog, Snapshot, repair_log
from wal.errors import WalCorruptionError
from wal.repair import WalRepairRefused, format_report
from wal.segment import RECORD_HEADER, SEGMENT_HEADER
from wal.survey import survey

SEG1 = "seg-00000000000000000001.wal"
SEG9 = "seg-00000000000000000009.wal"
SNAP8 = "snap-00000000000000000008.snap"
RECORD = RECORD_HEADER.size + 5  # every payload below is 5 bytes: b"rec01"


def payload(seq: int) -> bytes:
    return b"rec%02d" % seq


def record_at(seq: int, first_seq: int = 1) -> int:
    """Byte offset of record `seq` in a segment starting at `first_seq` (5-byte payloads)."""
    return SEGMENT_HEADER.size + (seq - first_seq) * RECORD


def reviewer_log(directory: Path) -> Path:
    """The reviewer's layout: one segment with records 1..12, the snapshot at seq 8."""
    with FileLog(directory) as log:
        for seq in range(1, 11):
            log.append(payload(seq))
        log.write_snapshot(b"state@8", seq=8)
        log.append(payload(11))
        log.append(payload(12))
    return directory


def segmented_log(directory: Path) -> Path:
    """Records 1..12 three to a segment (seg-1, seg-4, seg-7, seg-10), snapshots at 1 and 8:
    recovery starts from seg-7 (it holds seq 9), seg-1 and seg-4 are covered."""
    with FileLog(directory, segment_bytes=80, keep_snapshots=2) as log:
        for seq in range(1, 13):
            log.append(payload(seq))
            if seq == 1:
                log.write_snapshot(b"state@1")
        log.write_snapshot(b"state@8", seq=8)
    names = sorted(p.name for p in directory.glob("seg-*.wal"))
    assert names == [f"seg-{first:020d}.wal" for first in (1, 4, 7, 10)]
    return directory


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def state(directory: Path) -> tuple[Snapshot | None, list[tuple[int, bytes]]]:
    """What a daemon recovers: the latest snapshot and every record after it."""
    with FileLog(directory) as log:
        snap = log.latest_snapshot()
        after = snap.seq + 1 if snap else log.first_seq
        return snap, [(r.seq, r.payload) for r in log.records(after)]


def contents(directory: Path) -> set[bytes]:
    return {p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != "LOCK")


def assert_clean(directory: Path) -> None:
    found = survey(directory, full=True)
    assert (found.problem, found.torn) == (None, None)


# ---- damage the snapshot covers ----------------------------------------------------------


@pytest.mark.parametrize(
    "offset",
    [record_at(1) + 20, record_at(3) + 20, record_at(8) + 4, record_at(8) + 12, 3],
    ids=["record-1", "record-3-reviewer", "record-8-crc", "record-8-length", "header"],
)
def test_damage_the_snapshot_covers_keeps_the_snapshot_and_every_record_after_it(tmp_path, offset):
    directory = reviewer_log(tmp_path / "log")
    before = state(directory)
    assert before == (Snapshot(8, b"state@8"), [(s, payload(s)) for s in range(9, 13)])
    flip(directory / SEG1, offset)
    damaged = (directory / SEG1).read_bytes()
    everything = contents(directory)
    with pytest.raises(WalCorruptionError):
        FileLog(directory)

    report = repair_log(directory)

    assert state(directory) == before  # the snapshot and records 9..12, as acknowledged
    assert_clean(directory)
    assert files(directory) == [SEG9, SNAP8]
    quarantine = directory / "quarantine" / "repair-0001"
    assert (quarantine / SEG1).read_bytes() == damaged
    assert everything <= contents(directory)  # every byte is still somewhere
    assert report.kept == [
        f"{SEG9}: records 9..12 copied from {SEG1} bytes {record_at(9)}..{len(damaged)} "
        f"(records up to 8 are in {SNAP8})"
    ]
    assert report.moved == [(SEG1, str(quarantine / SEG1))]
    assert (report.first_seq, report.last_seq) == (9, 12)
    assert format_report(report).endswith(
        f"the log now holds records 9..12 and opens cleanly; nothing was deleted (see {quarantine})"
    )
    with FileLog(directory) as log:
        assert log.recovery.torn_tail is None
        assert log.append(b"next") == 13
    assert repair_log(directory).changed is False


def test_damage_in_the_start_segment_after_covered_segments_keeps_what_follows(tmp_path):
    directory = segmented_log(tmp_path / "log")
    before = state(directory)
    flip(directory / "seg-00000000000000000007.wal", record_at(7, 7) + 20)
    with pytest.raises(WalCorruptionError):  # a sealed segment: no torn tail
        FileLog(directory)

    report = repair_log(directory)

    assert files(directory) == [
        "seg-00000000000000000009.wal",
        "seg-00000000000000000010.wal",
        "snap-00000000000000000001.snap",
        SNAP8,
    ]
    assert_clean(directory)
    assert state(directory) == before
    assert before[1] == [(s, payload(s)) for s in range(9, 13)]
    assert [name for name, _ in report.moved] == [
        SEG1,
        "seg-00000000000000000004.wal",
        "seg-00000000000000000007.wal",
    ]


def test_a_record_after_the_snapshot_lost_too_keeps_the_snapshot(tmp_path):
    directory = reviewer_log(tmp_path / "log")
    flip(directory / SEG1, record_at(3) + 20)
    flip(directory / SEG1, record_at(9) + 20)  # record 9: nothing after it connects

    report = repair_log(directory)

    assert files(directory) == [SEG9, SNAP8]
    assert_clean(directory)
    assert state(directory) == (Snapshot(8, b"state@8"), [])
    assert report.kept == [
        f"{SEG9}: its header only (no intact record 9 in {SEG1}; records up to 8 are in {SNAP8})"
    ]
    with FileLog(directory) as log:
        assert log.append(b"next") == 9


def test_a_tail_torn_off_inside_records_the_snapshot_covers_keeps_the_snapshot(tmp_path):
    directory = reviewer_log(tmp_path / "log")
    with (directory / SEG1).open("r+b") as handle:
        handle.truncate(record_at(5) + 7)  # records 5..12 gone, record 5 half there
    with pytest.raises(WalCorruptionError) as info:
        FileLog(directory)
    assert info.value.reason == "snapshot covers up to seq 8 but the log ends at seq 4"

    report = repair_log(directory)

    assert state(directory) == (Snapshot(8, b"state@8"), [])
    assert_clean(directory)
    assert files(directory) == [SEG9, SNAP8]
    assert [name for name, _ in report.moved] == [SEG1]
    with FileLog(directory) as log:
        assert log.append(b"next") == 9


def test_a_gap_in_records_the_snapshot_covers_costs_only_the_covered_segments(tmp_path):
    directory = segmented_log(tmp_path / "log")
    before = state(directory)
    (directory / "seg-00000000000000000004.wal").unlink()  # records 4..6: covered
    assert state(directory) == before  # open reads from seg-7 on; verify and repair do not

    report = repair_log(directory)

    assert_clean(directory)
    assert state(directory) == before
    assert report.problems == [
        "seg-00000000000000000007.wal: byte offset 0: segment starts at seq 7 but the "
        "previous segment ends at seq 3"
    ]
    assert [name for name, _ in report.moved] == [SEG1]


# ---- damage after the snapshot: cut there, as before --------------------------------------


@pytest.mark.parametrize(
    ("damaged_seq", "last_kept"),
    [(9, 8), (10, 9), (12, 11)],
    ids=["record-9", "record-10", "last-record"],
)
def test_damage_after_the_snapshot_cuts_the_log_there_and_keeps_the_snapshot(
    tmp_path, damaged_seq, last_kept
):
    directory = reviewer_log(tmp_path / "log")
    flip(directory / SEG1, record_at(damaged_seq) + 20)
    original = (directory / SEG1).read_bytes()

    report = repair_log(directory)

    quarantine = directory / "quarantine" / "repair-0001"
    assert report.kept == [f"{SEG1}: bytes 0..{record_at(damaged_seq)} (records 1..{last_kept})"]
    assert report.moved == [
        (
            f"{SEG1} bytes {record_at(damaged_seq)}..{len(original)} (whole original copied)",
            str(quarantine / SEG1),
        )
    ]
    assert files(directory) == [SEG1, SNAP8]
    assert (quarantine / SEG1).read_bytes() == original
    assert_clean(directory)
    assert state(directory) == (
        Snapshot(8, b"state@8"),
        [(s, payload(s)) for s in range(9, last_kept + 1)],
    )
    with FileLog(directory) as log:
        assert log.append(b"next") == last_kept + 1


def test_a_torn_tail_after_the_snapshot_is_cut_and_the_snapshot_kept(tmp_path):
    directory = reviewer_log(tmp_path / "log")
    with (directory / SEG1).open("r+b") as handle:
        handle.truncate(record_at(12) + 7)

    report = repair_log(directory)

    assert report.kept == [f"{SEG1}: bytes 0..{record_at(12)} (records 1..11)"]
    assert_clean(directory)
    assert state(directory) == (
        Snapshot(8, b"state@8"),
        [(s, payload(s)) for s in range(9, 12)],
    )


# ---- the safety net ------------------------------------------------------------------------


def test_a_cut_that_would_end_the_log_before_a_good_snapshot_is_refused(tmp_path):
    directory = segmented_log(tmp_path / "log")
    (directory / "seg-00000000000000000007.wal").unlink()  # records 7..9: 9 is not covered
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    with pytest.raises(WalCorruptionError):
        FileLog(directory)

    with pytest.raises(WalRepairRefused) as info:
        repair_log(directory)

    assert info.value.exit_code == 2
    message = str(info.value)
    assert message.startswith(
        f"repair of {directory} refused: the fix for seg-00000000000000000010.wal (byte "
        f"offset 0: segment starts at seq 10 but the previous segment ends at seq 6) would "
        f"move seg-00000000000000000010.wal into quarantine and leave the log ending at seq "
        f"6, before the latest snapshot {SNAP8} (seq 8), which is good;"
    )
    assert "nothing was moved for this problem" in message
    assert not (directory / "quarantine").exists()
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before


def test_without_the_snapshot_aware_fix_the_cut_is_refused_before_anything_moves(
    tmp_path, monkeypatch
):
    import wal.repair

    directory = reviewer_log(tmp_path / "log")
    flip(directory / SEG1, record_at(3) + 20)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    monkeypatch.setattr(  # the reviewer's bug: cut the segment at the damage
        wal.repair,
        "_resume_after_snapshot",
        lambda found, index, issue, mover: wal.repair._cut(found, index, issue, mover),
    )

    with pytest.raises(WalRepairRefused) as info:
        repair_log(directory)

    assert "would move seg-00000000000000000001.wal into quarantine and leave the log" in str(
        info.value
    )
    assert f"ending at seq 2, before the latest snapshot {SNAP8} (seq 8)" in str(info.value)
    assert not (directory / "quarantine").exists()
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before


def test_a_good_snapshot_is_not_quarantined_after_repair_shortened_the_log(tmp_path, monkeypatch):
    import wal.repair

    directory = reviewer_log(tmp_path / "log")
    flip(directory / SEG1, record_at(3) + 20)
    snapshot = (directory / SNAP8).read_bytes()
    monkeypatch.setattr(  # both the fix and the check before the cut gone: the cut happens
        wal.repair,
        "_resume_after_snapshot",
        lambda found, index, issue, mover: wal.repair._cut(found, index, issue, mover),
    )
    monkeypatch.setattr(wal.repair, "_refuse_cut", lambda *args: None)

    with pytest.raises(WalRepairRefused) as info:
        repair_log(directory)

    quarantine = directory / "quarantine" / "repair-0001"
    assert info.value.exit_code == 2
    assert str(info.value) == (
        f"repair of {directory} refused: the latest snapshot {SNAP8} (seq 8) is good, but the "
        f"log now ends at seq 2 because this repair cut it ({SEG1} cut at byte offset "
        f"{record_at(3)}); it does not move a good snapshot into quarantine for that. The "
        f"snapshot is still in place; what was moved is in {quarantine}"
    )
    assert (directory / SNAP8).read_bytes() == snapshot
    assert sorted(p.name for p in quarantine.iterdir()) == [SEG1]
