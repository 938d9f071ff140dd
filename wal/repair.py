"""`muser wal repair DIR`: make a refused log open again, losing nothing silently.

Rule: keep everything recovery needs before the first bad byte; move the rest aside into
DIR/quarantine/repair-NNNN/, never delete it. Case by case (repeated until the log is clean):

- a bad record or header inside a segment recovery reads (at or after the latest snapshot):
  the segment's good prefix stays in place, the whole original file is copied into
  quarantine first (copy, fsync, then the prefix atomically replaces the original), and
  every later segment is renamed into quarantine. A torn tail is handled the same way.
- a bad segment wholly covered by the latest snapshot: that segment and every older one are
  renamed into quarantine; the snapshot and the segments after it are all recovery needs.
- a bad snapshot: renamed into quarantine; the previous snapshot (kept_snapshots >= 2)
  takes over.

A directory in a format version this build cannot read is refused, not repaired.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from wal import _fs
from wal.errors import WalError, WalUsageError
from wal.segment import SEGMENT_HEADER, SEGMENT_RE
from wal.survey import Problem, Survey, survey


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
        mover.rename(path)
        return
    index = next(i for i, s in enumerate(found.segments) if s.path == path)
    later = found.segments[index + 1 :]
    base = found.snapshot.seq if found.snapshot else 0
    if later and later[0].first_seq <= base + 1 and found.snapshot is not None:
        for info in found.segments[: index + 1]:  # covered by the snapshot: not needed
            mover.rename(info.path)
        return
    scan = found.segments[index].scan
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
    for info in later:
        mover.rename(info.path)


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
