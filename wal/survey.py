"""One read-only pass over a log directory: what recovery, the tools and repair all see.

`survey(directory, full=False)` is what open needs: the latest snapshot, every segment
header, and the records of the segments after the snapshot, which is why recovery time is
bounded by the snapshot interval and not by history. `full=True` also reads the segments and
snapshots the latest snapshot made redundant (verify, inspect, repair).

It never writes. The first problem found (in the order snapshots newest first, then
segments oldest first) is `problem`; a torn tail of the last segment is `torn` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from wal.segment import (
    SEGMENT_HEADER,
    SEGMENT_RE,
    SNAPSHOT_RE,
    SegmentScan,
    SnapshotFile,
    parse_segment_header,
    parse_snapshot,
    scan_segment,
)


@dataclass(frozen=True)
class Problem:
    """A place where good data ends: the file, the byte offset and why."""

    path: Path
    offset: int
    reason: str


@dataclass
class SegmentInfo:
    path: Path
    first_seq: int
    size: int
    scan: SegmentScan | None = None  # None when the survey did not need its records

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Survey:
    directory: Path
    segments: list[SegmentInfo]
    snapshot_paths: list[tuple[int, Path]]  # ascending seq
    snapshot: SnapshotFile | None = None  # the latest, when it is good
    snapshot_path: Path | None = None
    problem: Problem | None = None
    torn: Problem | None = None
    next_seq: int = 1  # the seq the next append gets
    start_index: int = 0  # first segment recovery reads
    scanned_segments: int = 0
    scanned_records: int = 0
    bad_snapshots: list[Problem] = field(default_factory=list)

    def note(self, problem: Problem) -> None:
        if self.problem is None:
            self.problem = problem


def list_files(directory: Path) -> tuple[list[tuple[int, Path]], list[tuple[int, Path]]]:
    """(segments, snapshots), each as (seq from the file name, path), ascending."""
    segments, snapshots = [], []
    for path in directory.iterdir():
        if match := SEGMENT_RE.match(path.name):
            segments.append((int(match.group(1)), path))
        elif match := SNAPSHOT_RE.match(path.name):
            snapshots.append((int(match.group(1)), path))
    return sorted(segments), sorted(snapshots)


def _read_snapshots(result: Survey, full: bool) -> None:
    for seq, path in reversed(result.snapshot_paths):
        snap, offset, reason = parse_snapshot(path.read_bytes(), path.name, seq)
        if snap is None:
            problem = Problem(path, offset, reason)
            result.bad_snapshots.append(problem)
            result.note(problem)
        elif result.snapshot is None and result.problem is None:
            result.snapshot, result.snapshot_path = snap, path
        if not full and (snap is None or result.snapshot is not None):
            return


def _scan(result: Survey, info: SegmentInfo) -> SegmentScan:
    scan = scan_segment(info.path.read_bytes(), info.name, info.first_seq)
    info.scan = scan
    result.scanned_segments += 1
    result.scanned_records += len(scan.offsets)
    return scan


def survey(directory: Path, *, full: bool = False) -> Survey:
    """Read the directory; see the module docstring for what is read and what is not."""
    seg_files, snap_files = list_files(directory)
    segments = [SegmentInfo(p, seq, p.stat().st_size) for seq, p in seg_files]
    result = Survey(directory, segments, snap_files)
    _read_snapshots(result, full)
    if result.problem is not None and not full:
        return result  # open refuses on a bad latest snapshot; reading on is wasted work
    base = result.snapshot.seq if result.snapshot else 0
    result.next_seq = base + 1
    if not segments:
        return result
    # the segment holding seq base + 1 (or the first one, which then must start there)
    start = max((i for i, s in enumerate(segments) if s.first_seq <= base + 1), default=0)
    result.start_index = start
    expected = None
    for index, info in enumerate(segments):
        if index < start and not full:  # covered by the snapshot: the header only
            with info.path.open("rb") as handle:
                header = handle.read(SEGMENT_HEADER.size)
            reason = parse_segment_header(header, info.name, info.first_seq)
            if reason is not None:
                result.note(Problem(info.path, 0, reason))
            continue
        if expected is not None and info.first_seq != expected:
            result.note(
                Problem(
                    info.path,
                    0,
                    f"segment starts at seq {info.first_seq} but the previous segment "
                    f"ends at seq {expected - 1}",
                )
            )
        if index == start and info.first_seq > base + 1:
            cover = (
                f"snapshot {result.snapshot_path.name} covers up to seq {base}"
                if result.snapshot
                else "no snapshot covers them"
            )
            result.note(
                Problem(
                    info.path,
                    0,
                    f"records {base + 1}..{info.first_seq - 1} are missing ({cover}; this "
                    f"segment starts at seq {info.first_seq})",
                )
            )
        scan = _scan(result, info)
        expected = scan.next_seq
        if scan.bad is not None:
            problem = Problem(info.path, scan.bad.offset, scan.bad.reason)
            if index == len(segments) - 1 and scan.bad.torn:
                result.torn = problem
            else:
                result.note(problem)
    last_seq = segments[-1].scan.next_seq - 1
    result.next_seq = max(last_seq, base) + 1
    if last_seq < base and result.snapshot_path is not None:
        result.note(
            Problem(
                result.snapshot_path,
                0,
                f"snapshot covers up to seq {base} but the log ends at seq {last_seq}",
            )
        )
    return result
