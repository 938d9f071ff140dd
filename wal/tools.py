"""What `muser wal inspect` and `muser wal verify` compute; read-only, lock-free.

Both read the whole directory (`survey(full=True)`), including segments the latest
snapshot made redundant. A torn tail is reported but is not a verify failure: it is what a
crash mid-append leaves, holds no acknowledged record, and the next open truncates it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from wal.base import Record, Snapshot
from wal.errors import WalUsageError
from wal.interpret import describe, registered_interpreters
from wal.segment import SNAPSHOT_HEADER
from wal.survey import Survey, list_files, survey

LOOK_BELOW = 3
"""How many directory levels under DIR `require_log` looks for the log DIR was meant to be
(a daemon's wal_dir holds its log in commit/ or journal/; the cluster's wal/ two above)."""


def _is_log(directory: Path) -> bool:
    """Whether `directory` is a log's: segment or snapshot files, or what repair left. A
    log has a segment from its first open on (an empty one too); repair may move every
    segment into quarantine/, and the next open starts a new one."""
    segments, snapshots = list_files(directory)
    return bool(segments or snapshots) or (directory / "quarantine").is_dir()


def _logs_below(directory: Path, depth: int = LOOK_BELOW) -> list[Path]:
    found = []
    try:
        children = sorted(p for p in directory.iterdir() if p.is_dir())
    except OSError:
        return found
    for child in children:
        if child.name == "quarantine":
            continue
        try:
            is_log = _is_log(child)
        except OSError:
            continue
        if is_log:
            found.append(child)
        elif depth > 1:
            found += _logs_below(child, depth - 1)
    return found


def require_log(directory: Path) -> None:
    """Refuse (WalUsageError, exit 2) what is not a log's directory, before anything reads
    or writes there: a missing path, a file, a directory without segment files (an empty or
    unrelated directory, or the wal_dir above a daemon's log, named if found)."""
    if not directory.is_dir():
        raise WalUsageError(f"{directory} is not a directory")
    try:
        if _is_log(directory):
            return
    except OSError as exc:
        raise WalUsageError(f"cannot read {directory}: {exc}") from exc
    below = _logs_below(directory)
    hint = f"; did you mean {' or '.join(map(str, below))}?" if below else ""
    raise WalUsageError(
        f"{directory} holds no commit log: no seg-*.wal segment (or snap-*.snap snapshot) "
        f"files; expected a log's own directory (a log has a segment file from its first "
        f"open on, even while empty){hint}"
    )


def _survey(directory: Path) -> Survey:
    require_log(directory)
    return survey(directory, full=True)


def _records(found: Survey) -> Iterator[Record]:
    """Every good record, in order, stopping at the first problem or gap."""
    expected = None
    for info in found.segments:
        scan = info.scan
        if expected is not None and scan.first_seq != expected:
            return
        for index in range(len(scan.offsets)):
            yield Record(scan.first_seq + index, scan.payload(index))
        expected = scan.next_seq
        if scan.bad is not None:
            return


def _problem_dict(problem) -> dict | None:
    if problem is None:
        return None
    return {"file": problem.path.name, "offset": problem.offset, "reason": problem.reason}


def inspect_log(directory: str | os.PathLike) -> dict:
    """Segments, snapshots, record counts, sequence range, sessions and heads, damage."""
    found = _survey(Path(directory))
    bad = {p.path: p for p in found.bad_snapshots}
    segments = []
    for info in found.segments:
        scan = info.scan
        status = "ok"
        if scan.bad is not None:
            kind = "torn tail" if found.torn and found.torn.path == info.path else "bad"
            status = f"{kind} at byte offset {scan.bad.offset}: {scan.bad.reason}"
        segments.append(
            {
                "file": info.name,
                "first_seq": scan.first_seq,
                "last_seq": scan.next_seq - 1,
                "records": len(scan.offsets),
                "bytes": info.size,
                "status": status,
            }
        )
    snapshots = [
        {
            "file": path.name,
            "seq": seq,
            "bytes": max(0, path.stat().st_size - SNAPSHOT_HEADER.size),
            "status": f"bad: {bad[path].reason}" if path in bad else "ok",
        }
        for seq, path in found.snapshot_paths
    ]
    sessions: dict[str, dict] = {}
    count = 0
    for record in _records(found):
        count += 1
        described = describe(record.payload)
        if described is None:
            continue
        entry = sessions.setdefault(str(described["session"]), {"rounds": 0})
        entry["rounds"] += 1
        entry["last_round"] = described.get("round")
        entry["head"] = described.get("head")
        entry["last_seq"] = record.seq
    seqs = [s for s in segments if s["records"]]
    return {
        "directory": str(directory),
        "segments": segments,
        "snapshots": snapshots,
        "records": count,
        "first_seq": seqs[0]["first_seq"] if seqs else None,
        "last_seq": seqs[-1]["last_seq"] if seqs else None,
        "latest_snapshot_seq": found.snapshot.seq if found.snapshot else None,
        "torn_tail": _problem_dict(found.torn),
        "corruption": _problem_dict(found.problem),
        "interpreters": [i.name for i in registered_interpreters()],
        "sessions": sessions,
    }


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    failure: str | None  # the first failure, one line, naming file and offset or seq
    records: int
    segments: int
    snapshots: int
    chain_checked_by: tuple[str, ...]
    torn_tail: str | None

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "failure": self.failure,
            "records": self.records,
            "segments": self.segments,
            "snapshots": self.snapshots,
            "chain_checked_by": list(self.chain_checked_by),
            "torn_tail": self.torn_tail,
        }


def verify_log(directory: str | os.PathLike, pubkeys: Sequence[bytes] = ()) -> VerifyResult:
    """Every header and checksum, seq continuity, then each interpreter's chain check."""
    found = _survey(Path(directory))
    records = list(_records(found))
    torn = found.torn
    torn_line = f"{torn.path.name} at byte offset {torn.offset}: {torn.reason}" if torn else None
    failure = None
    if found.problem is not None:
        p = found.problem
        failure = f"{p.path}: byte offset {p.offset}: {p.reason}"
    checked = []
    snap = Snapshot(found.snapshot.seq, found.snapshot.data) if found.snapshot else None
    for interpreter in registered_interpreters():
        if failure is not None:
            break
        checked.append(interpreter.name)
        failure = interpreter.check_chain(iter(records), list(pubkeys), snap)
        if failure is not None:
            failure = f"{interpreter.name}: {failure}"
    return VerifyResult(
        ok=failure is None,
        failure=failure,
        records=len(records),
        segments=len(found.segments),
        snapshots=len(found.snapshot_paths),
        chain_checked_by=tuple(checked),
        torn_tail=torn_line,
    )
