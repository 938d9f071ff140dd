"""The commit log: segmented, checksummed, fsynced, group-committed.

ON-DISK FORMAT, version 1 (all integers little-endian; encoding code in wal/segment.py)

    DIR/
      LOCK                               flock'd by the one writer (kernel drops it on death)
      seg-00000000000000000001.wal       a segment; its first record has seq 1
      seg-00000000000000004097.wal       the next one continues at seq 4097
      snap-00000000000000004000.snap     a snapshot: daemon state covering seq <= 4000
      quarantine/repair-0001/            what `muser wal repair` moved aside (never read)

    segment  = header record*                       (no padding, no footer)
    header   = +----------------+-----------+-------------+-------------+
               | magic          | version   | first_seq   | crc         |   24 bytes
               | "MUSERWAL" (8) | u32 = 1   | u64         | u32         |
               +----------------+-----------+-------------+-------------+
               crc = CRC32C(the 20 bytes before it)
    record   = +-------------+-------+--------+-------+-----------------+
               | marker      | crc   | length | seq   | payload         |   20 + length
               | a5 57 52 5a | u32   | u32    | u64   | `length` bytes  |
               +-------------+-------+--------+-------+-----------------+
               crc = CRC32C(length | seq | payload)   (Castagnoli, the `crc32c` package)
               seq = first_seq + index in segment; the next segment's first_seq continues
               exactly where this one ends (no gap, no repeat). The marker only lets
               recovery find a good record after a bad one; it is not trusted alone.
    snapshot = | "MUSERSNP" (8) | version u32 | seq u64 | length u64 | crc u32 | data |
               crc = CRC32C(version | seq | length | data)

FSYNC RULES
    commit    `append` write(2)s its record, then returns only after an fdatasync of the
              segment (F_FULLFSYNC on macOS) that began after that write finished. One fsync
              covers every record written before it began: that is the group commit.
    create    a segment is born whole: header to `seg-X.wal.tmp`, fsync, rename to
              `seg-X.wal`, fsync DIR. Rollover fsyncs the old segment first, so only the last
              segment can ever end in a partial record.
    snapshot  `snap-X.snap.tmp`, fsync, rename, fsync DIR; then unlink the snapshots beyond
              `keep_snapshots` and the segments whose records all lie at or below the oldest
              kept snapshot, oldest first, and fsync DIR.
    truncate  a torn tail is cut with ftruncate, then the segment is fsynced.
    repair    copies or renames into quarantine/ (fsynced) before it cuts anything, then
              fsyncs both directories (wal/repair.py).

GROUP COMMIT (wal/group.py)
    `append` (any thread) and `append_async` (any event loop) queue their record; the
    writer-role holder writes the whole queue with one write(2) and starts one fsync for it.
    Up to 4 batches' fsyncs overlap (the kernel serves concurrent fsyncs of a file
    together); a record is acknowledged only once its batch's fsync, and every earlier
    batch's, has succeeded. A lone appender writes and fsyncs itself (no thread handoff);
    under load a flusher thread writes; an asyncio caller never waits on an fsync in its loop.

RECOVERY (on open; wal/survey.py)
    Deletes `seg-*.tmp` / `snap-*.tmp` left by an interrupted create or snapshot (never
    renamed, so never part of the log). Reads the latest snapshot, every segment header, and the records of the segments from
    the one holding snapshot seq + 1: open time is bounded by the snapshot interval.
    A bad record in the last segment with no good record after it (partial header, length
    past the end, checksum mismatch: what a crash mid-append leaves) is a torn tail: it is
    truncated and reported as `log.recovery.torn_tail`. Anything else that is wrong - a bad
    record with a good one after it, a bad record in a sealed segment, a bad header, a seq
    gap, a bad latest snapshot - refuses the open with WalCorruptionError naming the file and
    byte offset, and telling the operator to run `muser wal repair DIR`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from wal import _fs
from wal.base import Record, RecoveryReport, Snapshot, TornTail
from wal.errors import (
    WalClosedError,
    WalCorruptionError,
    WalIOError,
    WalUsageError,
)
from wal.group import GroupCommit
from wal.segment import (
    MAX_RECORD_BYTES,
    encode_record,
    encode_segment_header,
    encode_snapshot,
    scan_segment,
    segment_name,
    snapshot_name,
)
from wal.survey import survey

DEFAULT_SEGMENT_BYTES = 8 << 20
DEFAULT_MAX_RECORD_BYTES = 64 << 20


def check_payload(payload: object, max_bytes: int) -> bytes:
    """The payload as bytes, or WalUsageError quoting what was received."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise WalUsageError(f"payload must be bytes, got {type(payload).__name__}")
    data = bytes(payload)
    if len(data) > max_bytes:
        raise WalUsageError(f"payload is {len(data)} bytes; this log takes at most {max_bytes}")
    return data


class _Active:
    """An open segment file. fsyncs in flight hold references; the fd is closed by whoever
    drops the last one after the segment was sealed (rollover) or the log closed."""

    __slots__ = ("path", "fd", "refs", "retired")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.refs = 0
        self.retired = False


class FileLog:
    """The on-disk commit log. One writer per directory (enforced by flock on DIR/LOCK).

    Thread-safe: `append` from any number of threads and `append_async` from event loops
    share fsyncs through `wal.group.GroupCommit`. Only its writer-role holder writes and
    rolls segments over; fsyncs may overlap (each holds a reference on its segment's fd).
    `_state` guards what readers, snapshots and fsyncs share: the durable seq, the segment
    list and the fd references.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        keep_snapshots: int = 2,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        on_fsync: Callable[[float], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """`on_fsync(seconds)` is called, from the thread that ran it, after each successful
        fsync of a commit or a rollover (the daemons' stats observe fsync latency there).
        `on_failure(reason)` is called once, from the thread that saw it, when a write or
        an fsync fails and the log starts refusing appends (a daemon's health reports it);
        it must not block."""
        if segment_bytes < 64:
            raise WalUsageError(f"segment_bytes must be >= 64, got {segment_bytes}")
        if keep_snapshots < 1:
            raise WalUsageError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        if not 0 < max_record_bytes <= MAX_RECORD_BYTES:
            raise WalUsageError(
                f"max_record_bytes must be in 1..{MAX_RECORD_BYTES}, got {max_record_bytes}"
            )
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise WalUsageError(f"{self.directory} exists and is not a directory")
        self.segment_bytes = segment_bytes
        self.keep_snapshots = keep_snapshots
        self.max_record_bytes = max_record_bytes
        self.on_fsync = on_fsync
        self._state = threading.Lock()
        self._snapshot_lock = threading.Lock()
        self._closed = False
        self._active: _Active | None = None
        _fs.ensure_dir(self.directory)
        self._dir_lock = _fs.DirLock(self.directory)
        try:
            self._recover()
        except BaseException:
            self._dir_lock.release()
            raise
        self._group = GroupCommit(
            self._write_records,
            self._sync,
            self._acknowledged,
            str(self.directory),
            on_failure=on_failure,
        )

    # ---- open ---------------------------------------------------------------------------

    def _recover(self) -> None:
        leftovers = [p for p in self.directory.glob("*.tmp") if p.name[:4] in ("seg-", "snap")]
        for path in leftovers:  # a crashed create or snapshot: never renamed, never used
            path.unlink()
        if leftovers:
            _fs.fsync_dir(self.directory)
        found = survey(self.directory)
        if found.problem is not None:
            p = found.problem
            raise WalCorruptionError(p.path, p.offset, p.reason, self.directory)
        torn = None
        if found.torn is not None:
            t = found.torn
            size = t.path.stat().st_size
            fd = os.open(t.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, t.offset)
                _fs.fsync_file(fd)
            finally:
                os.close(fd)
            torn = TornTail(t.path.name, t.offset, size - t.offset, t.reason)
        snap = found.snapshot
        self._snapshot = Snapshot(snap.seq, snap.data) if snap else None
        self._snapshot_seqs = [seq for seq, _ in found.snapshot_paths]
        self._segments = [(s.first_seq, s.path) for s in found.segments]
        self._next_seq = found.next_seq
        self._durable = found.next_seq - 1
        if self._segments:
            last = found.segments[-1]
            self._active = _Active(last.path)
            self._seg_size = last.scan.end
            self._seg_records = len(last.scan.offsets)
        else:
            self._create_segment(self._next_seq)
        self.recovery = RecoveryReport(
            snapshot_seq=snap.seq if snap else 0,
            last_seq=self._durable,
            segments_scanned=found.scanned_segments,
            records_scanned=found.scanned_records,
            torn_tail=torn,
        )

    def _create_segment(self, first_seq: int) -> None:
        """A new active segment, born whole (see FSYNC RULES: create)."""
        path = self.directory / segment_name(first_seq)
        header = encode_segment_header(first_seq)
        _fs.atomic_write(path, header)
        self._active = _Active(path)
        with self._state:
            self._segments.append((first_seq, path))
        self._seg_size = len(header)
        self._seg_records = 0

    # ---- state --------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._durable

    @property
    def first_seq(self) -> int:
        with self._state:
            return self._segments[0][0] if self._segments else self._next_seq

    def latest_snapshot(self) -> Snapshot | None:
        return self._snapshot

    @property
    def failed(self) -> str | None:
        """Why the log refuses appends (a write or an fsync failed), or None."""
        return self._group.failed

    def _check_open(self) -> None:
        if self._closed:
            raise WalClosedError(f"the log at {self.directory} is closed")
        if self._group.failed is not None:
            raise WalIOError(self._group.failed)

    # ---- append -------------------------------------------------------------------------

    def append(self, payload: bytes) -> int:
        """Append one record and return its seq once it is durable (blocks the caller)."""
        return self._group.commit(check_payload(payload, self.max_record_bytes))

    def append_many(self, payloads: list[bytes]) -> list[int]:
        """Append records together (one write and one fsync when nobody else is writing);
        block until all are durable; their seqs, in order."""
        return self._group.commit_many([check_payload(p, self.max_record_bytes) for p in payloads])

    async def append_async(self, payload: bytes) -> int:
        """Append one record; await durability without blocking the event loop."""
        return await self._group.commit_async(check_payload(payload, self.max_record_bytes))

    async def append_many_async(self, payloads: list[bytes]) -> list[int]:
        """`append_many` awaited without blocking the event loop (one write and one fsync
        when nobody else is writing)."""
        checked = [check_payload(p, self.max_record_bytes) for p in payloads]
        return await self._group.commit_many_async(checked)

    def _write_records(self, payloads: list[bytes]) -> tuple[int, _Active]:
        """Write a batch (rolling over as needed); only the writer-role holder calls this.
        Returns the first seq and the segment whose fsync makes the batch durable."""
        first = seq = self._next_seq
        chunks: list[bytes] = []
        try:
            for payload in payloads:
                if self._seg_size >= self.segment_bytes and self._seg_records:
                    _fs.write_all(self._active.fd, b"".join(chunks))
                    chunks = []
                    self._rollover(seq)
                record = encode_record(seq, payload)
                chunks.append(record)
                self._seg_size += len(record)
                self._seg_records += 1
                seq += 1
            _fs.write_all(self._active.fd, b"".join(chunks))
        except OSError as exc:
            # A partial record may be on disk and nothing may follow it: the group commit
            # poisons the log, and the next open truncates the torn tail.
            raise WalIOError(
                f"writing seq {first}..{seq} to {self._active.path} failed: {exc}"
            ) from exc
        self._next_seq = seq
        with self._state:
            self._active.refs += 1
        return first, self._active

    def _sync(self, segment: _Active) -> None:
        """fsync one segment: every record written to it before this call becomes durable."""
        try:
            self._timed_fsync(segment.fd)
        except OSError as exc:
            raise WalIOError(f"fsync of {segment.path} failed: {exc}") from exc
        finally:
            with self._state:
                segment.refs -= 1
                self._close_if_unused(segment)

    def _acknowledged(self, seq: int) -> None:
        """Every record up to seq is durable and acknowledged, in order (from GroupCommit)."""
        with self._state:
            self._durable = seq

    def _timed_fsync(self, fd: int) -> None:
        t0 = time.perf_counter()
        _fs.fsync_file(fd)
        if self.on_fsync is not None:
            self.on_fsync(time.perf_counter() - t0)

    @staticmethod
    def _close_if_unused(segment: _Active) -> None:
        if segment.retired and segment.refs == 0 and segment.fd >= 0:
            os.close(segment.fd)
            segment.fd = -1

    def _rollover(self, next_seq: int) -> None:
        """Seal the active segment (fsync) and start the next one at `next_seq`."""
        sealed = self._active
        self._timed_fsync(sealed.fd)  # only the last segment may ever end in a partial record
        self._create_segment(next_seq)
        with self._state:
            sealed.retired = True
            self._close_if_unused(sealed)

    # ---- read ---------------------------------------------------------------------------

    def records(self, from_seq: int = 1) -> Iterator[Record]:
        """Durable records with seq >= from_seq. Segments are read lazily, one at a time."""
        with self._state:
            self._check_open()
            first = self._segments[0][0] if self._segments else self._next_seq
            end, segments = self._durable, list(self._segments)
        if from_seq < first:
            raise WalUsageError(
                f"records before seq {first} were dropped after a snapshot; asked for "
                f"seq {from_seq} (read latest_snapshot() and then records({first}))"
            )
        return self._iter_records(from_seq, end, segments)

    def _iter_records(self, from_seq: int, end: int, segments: list) -> Iterator[Record]:
        for index, (first, path) in enumerate(segments):
            stop = min(end, segments[index + 1][0] - 1 if index + 1 < len(segments) else end)
            if stop < from_seq:
                continue
            try:
                data = path.read_bytes()
            except FileNotFoundError as exc:
                raise WalUsageError(
                    f"{path.name} was dropped by a snapshot while records() was reading it"
                ) from exc
            scan = scan_segment(data, path.name, first)
            for index_in, seq in enumerate(range(first, min(stop, scan.next_seq - 1) + 1)):
                if seq >= from_seq:
                    yield Record(seq, scan.payload(index_in))
            if scan.next_seq <= stop:
                offset = scan.bad.offset if scan.bad else scan.end
                reason = scan.bad.reason if scan.bad else "segment ends early"
                raise WalCorruptionError(path, offset, reason, self.directory)

    # ---- snapshots ----------------------------------------------------------------------

    def write_snapshot(self, data: bytes, seq: int | None = None) -> Snapshot:
        """Durably record `data` as the state after seq (default last_seq); drop what no kept
        snapshot needs any more. Appends continue while the snapshot is written."""
        state = check_payload(data, MAX_RECORD_BYTES)
        with self._snapshot_lock:
            with self._state:
                self._check_open()
                durable = self._durable
            seq = durable if seq is None else seq
            floor = self._snapshot.seq if self._snapshot else 0
            if not floor <= seq <= durable:
                raise WalUsageError(
                    f"snapshot seq must be in {floor}..{durable} (latest snapshot..last "
                    f"durable seq), got {seq}"
                )
            try:
                _fs.atomic_write(self.directory / snapshot_name(seq), encode_snapshot(seq, state))
            except OSError as exc:
                raise WalIOError(
                    f"writing snapshot {seq} in {self.directory} failed: {exc}"
                ) from exc
            self._snapshot = Snapshot(seq, state)
            self._snapshot_seqs = sorted(set(self._snapshot_seqs) | {seq})
            self._drop_redundant()
            return self._snapshot

    def _drop_redundant(self) -> None:
        kept = self._snapshot_seqs[-self.keep_snapshots :]
        doomed = [self.directory / snapshot_name(s) for s in self._snapshot_seqs[: -len(kept)]]
        with self._state:
            segs = self._segments
            count = 0
            while count + 1 < len(segs) and segs[count + 1][0] <= kept[0] + 1:
                count += 1
            doomed += [path for _, path in segs[:count]]
            self._segments = segs[count:]
        self._snapshot_seqs = kept
        if doomed:
            for path in doomed:  # oldest first: a crash leaves a contiguous suffix
                path.unlink(missing_ok=True)
            _fs.fsync_dir(self.directory)

    # ---- close --------------------------------------------------------------------------

    def close(self) -> None:
        """Make every queued record durable, stop the flusher, release the directory."""
        if self._closed:
            return
        self._group.close()
        with self._state:
            self._closed = True
            if self._active is not None:
                self._active.retired = True
                self._close_if_unused(self._active)
        self._dir_lock.release()

    def __enter__(self) -> FileLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
