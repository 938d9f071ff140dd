"""`muser wal repair DIR`: make a refused log open again, losing nothing silently.

Rule: keep everything recovery needs before the first bad byte; move the rest aside into
DIR/quarantine/repair-NNNN/, never delete it. Case by case (repeated until the log is clean):

- a bad record or header inside a segment recovery reads (at or after the latest snapshot):
  the segment's good prefix stays in place, the whole original file is copied into
  quarantine first (copy, fsync, then the prefix atomically replaces the original), and
  every later segment is renamed into quarantine. A torn tail is handled the same way.
- a bad record (or header) that the latest good snapshot covers, in the segment recovery
  starts from (the one holding snapshot seq + 1), or a tail torn off inside those records
  (no crash tears a record a snapshot covers): the snapshot stays, and so does every
  intact record after it. The bytes from record snapshot seq + 1 on are copied into a new
  segment `seg-<snapshot seq + 1>.wal` (born whole: temp file, fsync, rename, fsync DIR),
  then the damaged segment and every older one are renamed into quarantine. When record
  snapshot seq + 1 cannot be found the new segment holds its header only and the later
  segments, which no longer connect to the snapshot, go to quarantine too.
- a bad segment wholly covered by the latest snapshot: that segment and every older one are
  renamed into quarantine; the snapshot and the segments after it are all recovery needs.
  So are the segments before the one recovery starts from when only the seam between them
  is wrong (a gap in records the snapshot covers).
- a bad snapshot: renamed into quarantine; the previous snapshot (kept_snapshots >= 2)
  takes over. So is a good latest snapshot beyond the end of a log that ends cleanly on a
  record boundary (no torn record, nothing this repair cut): on disk a lost tail and a
  stray snapshot look the same.

Safety net: repair never gives up a good latest snapshot because a cut of its own left the
log ending before it. A cut that would do that is refused (`WalRepairRefused`, exit 2)
before anything of it is moved, and so is quarantining the snapshot after such a cut.

A directory in a format version this build cannot read is refused, not repaired.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from wal import _fs
from wal.errors import WalError, WalUsageError
from wal.segment import (
    SEGMENT_HEADER,
    SEGMENT_RE,
    check_record,
    encode_segment_header,
    find_valid_record,
    scan_segment,
    segment_name,
)
from wal.survey import Problem, SegmentInfo, Survey, survey


class WalRepairRefused(WalError):
    """Repair stopped rather than move a good latest snapshot into quarantine (exit 2): the
    step it refused moved nothing; what earlier steps moved is in the quarantine directory."""

    exit_code = 2


@dataclass
class RepairReport:
    directory: Path
    problems: list[str] = field(default_factory=list)  # what was wrong, in the order fixed
    kept: list[str] = field(default_factory=list)  # good prefixes left in place
    moved: list[tuple[str, str]] = field(default_factory=list)  # (file, where it went)
    quarantine: Path | None = None
    first_seq: int = 1
    last_seq: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.moved)

    def to_dict(self) -> dict:
        return {
            "directory": str(self.directory),
            "problems": self.problems,
            "kept": self.kept,
            "moved": [{"file": f, "to": t} for f, t in self.moved],
            "quarantine": str(self.quarantine) if self.quarantine else None,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
        }


class _Mover:
    """Moves files into one fresh quarantine/repair-NNNN directory, created on first use."""

    def __init__(self, directory: Path, report: RepairReport) -> None:
        self.directory = directory
        self.report = report
        self.target: Path | None = None
        self.shortened: list[str] = []  # cuts that dropped records from the end of the log

    def _dir(self) -> Path:
        if self.target is None:
            root = self.directory / "quarantine"
            _fs.ensure_dir(root)
            taken = [p.name for p in root.iterdir() if p.name.startswith("repair-")]
            number = 1 + max((int(n[7:]) for n in taken if n[7:].isdigit()), default=0)
            self.target = root / f"repair-{number:04d}"
            self.target.mkdir()
            _fs.fsync_dir(root)
            self.report.quarantine = self.target
        return self.target

    def _free(self, name: str) -> Path:
        target, n = self._dir() / name, 0
        while target.exists():  # the same name moved twice in one run: keep both
            n += 1
            target = self._dir() / f"{name}.{n}"
        return target

    def rename(self, path: Path) -> None:
        target = self._free(path.name)
        os.replace(path, target)
        _fs.fsync_dir(target.parent)
        _fs.fsync_dir(path.parent)
        self.report.moved.append((path.name, str(target)))

    def keep_prefix(self, path: Path, offset: int) -> None:
        """Copy the original aside (durably), then cut the file back to `offset` bytes."""
        data = path.read_bytes()
        copy = self._free(path.name)
        _fs.atomic_write(copy, data)
        _fs.atomic_write(path, data[:offset])
        self.report.moved.append(
            (f"{path.name} bytes {offset}..{len(data)} (whole original copied)", str(copy))
        )


def _fix_one(found: Survey, issue: Problem, mover: _Mover) -> None:
    path = issue.path
    if not SEGMENT_RE.match(path.name):  # a snapshot
        if path == found.snapshot_path:  # a good one, beyond the end of the log
            if found.torn is not None:  # no crash tears a record a snapshot covers: damage
                _resume_after_snapshot(found, len(found.segments) - 1, found.torn, mover)
                return
            _refuse_if_repair_shortened(found, mover)
        mover.rename(path)
        return
    index = next(i for i, s in enumerate(found.segments) if s.path == path)
    info = found.segments[index]
    later = found.segments[index + 1 :]
    base = found.snapshot.seq if found.snapshot else 0
    if later and later[0].first_seq <= base + 1 and found.snapshot is not None:
        for older in found.segments[: index + 1]:  # covered by the snapshot: not needed
            mover.rename(older.path)
        return
    scan = info.scan
    in_bytes = scan is not None and scan.bad is not None and scan.bad.offset == issue.offset
    if found.snapshot is not None and in_bytes and scan.next_seq <= base:
        _resume_after_snapshot(found, index, issue, mover)
        return
    if found.snapshot is not None and not in_bytes and 0 < index == found.start_index:
        # the seam between the covered segments and the one recovery starts from
        for older in found.segments[:index]:
            mover.rename(older.path)
        return
    _cut(found, index, issue, mover)


def _cut(found: Survey, index: int, issue: Problem, mover: _Mover) -> None:
    """Keep the good prefix of segment `index` (nothing of it for a bad header or a seam),
    move the rest and every later segment into quarantine."""
    info = found.segments[index]
    path, scan = info.path, info.scan
    if issue.offset >= SEGMENT_HEADER.size:
        end = scan.next_seq - 1 if scan is not None else info.first_seq - 1
    elif index > 0:
        before = found.segments[index - 1]
        end = before.scan.next_seq - 1 if before.scan is not None else info.first_seq - 1
    else:
        end = None  # no segment is left: the snapshot alone is the log
    if found.snapshot is not None and end is not None and end < found.snapshot.seq:
        _refuse_cut(found, issue, end, [path, *(s.path for s in found.segments[index + 1 :])])
    if issue.offset >= SEGMENT_HEADER.size and scan is not None and scan.offsets:
        mover.keep_prefix(path, issue.offset)
        last = scan.next_seq - 1
        mover.report.kept.append(
            f"{path.name}: bytes 0..{issue.offset} (records {scan.first_seq}..{last})"
        )
    elif issue.offset >= SEGMENT_HEADER.size:
        mover.keep_prefix(path, issue.offset)
        mover.report.kept.append(f"{path.name}: its header only (no good record)")
    else:
        mover.rename(path)
    for after in found.segments[index + 1 :]:
        mover.rename(after.path)
    mover.shortened.append(f"{path.name} cut at byte offset {issue.offset}")


def _resume_after_snapshot(found: Survey, index: int, issue: Problem, mover: _Mover) -> None:
    """Damage the latest good snapshot covers, in the segment recovery starts from: copy the
    bytes from record snapshot seq + 1 on into a new segment starting there (born whole),
    then move the damaged segment and the older ones into quarantine. Open reads nothing
    before snapshot seq + 1, so the log keeps the snapshot and every intact record after it.
    Without an intact record snapshot seq + 1 the new segment holds its header only, and the
    later segments (which no longer connect to the snapshot) go to quarantine as well."""
    info = found.segments[index]
    base = found.snapshot.seq
    data = info.scan.data
    start = find_valid_record(data, issue.offset + 1, base + 1)
    if start is not None and check_record(data, start)[0] != base + 1:
        start = None  # the first good record after the damage is not base + 1: base + 1 is lost
    target = found.directory / segment_name(base + 1)
    if target.exists():  # it would have been the next segment, handled as covered damage
        raise WalError(f"repair of {found.directory}: {target.name} exists already")
    tail = data[start:] if start is not None else b""
    content = encode_segment_header(base + 1) + tail
    _fs.atomic_write(target, content)  # first: until the moves below, open reads this one
    rescued = scan_segment(content, target.name, base + 1)
    snap = found.snapshot_path.name
    if rescued.offsets:
        mover.report.kept.append(
            f"{target.name}: records {base + 1}..{rescued.next_seq - 1} copied from "
            f"{info.name} bytes {start}..{len(data)} (records up to {base} are in {snap})"
        )
    else:
        mover.report.kept.append(
            f"{target.name}: its header only (no intact record {base + 1} in {info.name}; "
            f"records up to {base} are in {snap})"
        )
    unneeded = found.segments[: index + 1] if start is not None else found.segments
    for segment in unneeded:
        mover.rename(segment.path)


def _log_end(segments: list[SegmentInfo]) -> int:
    last = segments[-1].scan if segments else None
    return last.next_seq - 1 if last is not None else 0


def _refuse_cut(found: Survey, issue: Problem, end: int, doomed: list[Path]) -> None:
    """The safety net, before a cut: refuse one that would leave the log ending before the
    latest good snapshot (repair would then have to move the snapshot into quarantine)."""
    snap, base = found.snapshot_path.name, found.snapshot.seq
    names = ", ".join(p.name for p in doomed)
    raise WalRepairRefused(
        f"repair of {found.directory} refused: the fix for {issue.path.name} (byte offset "
        f"{issue.offset}: {issue.reason}) would move {names} into quarantine and leave the "
        f"log ending at seq {end}, before the latest snapshot {snap} (seq {base}), which is "
        f"good; repair does not give up a good snapshot for that, so nothing was moved for "
        f"this problem. Restore the missing segment files; or, to keep the snapshot without "
        f"the records that no longer connect to it, move every seg-*.wal file into "
        f"{found.directory / 'quarantine'}/ by hand"
    )


def _refuse_if_repair_shortened(found: Survey, mover: _Mover) -> None:
    """The safety net, after a cut: a good snapshot beyond the end of the log is moved into
    quarantine only when the log ended there before this repair cut anything."""
    if not mover.shortened:
        return
    snap, base = found.snapshot_path.name, found.snapshot.seq
    raise WalRepairRefused(
        f"repair of {found.directory} refused: the latest snapshot {snap} (seq {base}) is "
        f"good, but the log now ends at seq {_log_end(found.segments)} because this repair "
        f"cut it ({'; '.join(mover.shortened)}); it does not move a good snapshot into "
        f"quarantine for that. The snapshot is still in place; what was moved is in "
        f"{mover.report.quarantine}"
    )


def repair_log(directory: str | os.PathLike) -> RepairReport:
    """Repair `directory` in place (takes the writer lock); see the module docstring."""
    directory = Path(directory)
    if not directory.is_dir():
        raise WalUsageError(f"{directory} is not a directory")
    report = RepairReport(directory)
    lock = _fs.DirLock(directory)
    try:
        mover = _Mover(directory, report)
        budget = 2 + sum(1 for _ in directory.iterdir())
        while True:
            found = survey(directory, full=True)
            issue = found.problem or found.torn
            if issue is None:
                break
            budget -= 1
            if budget < 0:
                raise WalError(f"repair of {directory} did not converge at {issue}")
            report.problems.append(f"{issue.path.name}: byte offset {issue.offset}: {issue.reason}")
            _fix_one(found, issue, mover)
        report.first_seq = found.segments[0].first_seq if found.segments else found.next_seq
        report.last_seq = found.next_seq - 1
    finally:
        lock.release()
    return report


def format_report(report: RepairReport) -> str:
    """What repair did, for a person."""
    if not report.changed:
        return (
            f"{report.directory}: nothing to repair; records {report.first_seq}.."
            f"{report.last_seq} are intact"
        )
    lines = [f"repaired {report.directory}:"]
    lines += [f"  problem: {p}" for p in report.problems]
    lines += [f"  kept:    {k}" for k in report.kept]
    lines += [f"  moved:   {f} -> {t}" for f, t in report.moved]
    lines.append(
        f"  the log now holds records {report.first_seq}..{report.last_seq} and opens cleanly; "
        f"nothing was deleted (see {report.quarantine})"
    )
    return "\n".join(lines)
