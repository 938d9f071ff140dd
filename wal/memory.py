"""The in-memory commit log: the same contract as FileLog, without a disk.

For tests of the daemons and for the contract suite. A `MemoryLogStore` outlives the
`MemoryLog`s opened on it, so "close and reopen" means what it means on disk.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from wal.base import Record, RecoveryReport, Snapshot
from wal.errors import WalClosedError, WalLockedError, WalUsageError
from wal.log import DEFAULT_MAX_RECORD_BYTES, check_payload
from wal.segment import MAX_RECORD_BYTES


@dataclass
class MemoryLogStore:
    """What a MemoryLog keeps across close/reopen: records after `first_seq`, snapshots."""

    records: list[bytes] = field(default_factory=list)  # records[i] has seq first_seq + i
    first_seq: int = 1
    snapshots: list[Snapshot] = field(default_factory=list)  # ascending seq
    is_open: bool = False


class MemoryLog:
    """A CommitLog in a list. Every append is "durable" when it returns."""

    def __init__(
        self,
        store: MemoryLogStore | None = None,
        *,
        keep_snapshots: int = 2,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ) -> None:
        if keep_snapshots < 1:
            raise WalUsageError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        self.store = store if store is not None else MemoryLogStore()
        if self.store.is_open:
            raise WalLockedError("this MemoryLogStore is already open in another MemoryLog")
        self.store.is_open = True
        self.keep_snapshots = keep_snapshots
        self.max_record_bytes = max_record_bytes
        self._lock = threading.Lock()
        self._closed = False
        snap = self.latest_snapshot()
        base = snap.seq if snap else 0
        self.recovery = RecoveryReport(
            snapshot_seq=base,
            last_seq=self.last_seq,
            segments_scanned=0,
            records_scanned=self.last_seq - max(base, self.store.first_seq - 1),
            torn_tail=None,
        )

    @property
    def last_seq(self) -> int:
        return self.store.first_seq + len(self.store.records) - 1

    @property
    def first_seq(self) -> int:
        return self.store.first_seq

    def _check_open(self) -> None:
        if self._closed:
            raise WalClosedError("the memory log is closed")

    def append(self, payload: bytes) -> int:
        data = check_payload(payload, self.max_record_bytes)
        with self._lock:
            self._check_open()
            self.store.records.append(data)
            return self.last_seq

    def append_many(self, payloads: list[bytes]) -> list[int]:
        data = [check_payload(p, self.max_record_bytes) for p in payloads]
        with self._lock:
            self._check_open()
            first = self.last_seq + 1
            self.store.records.extend(data)
            return list(range(first, first + len(data)))

    async def append_async(self, payload: bytes) -> int:
        return self.append(payload)

    async def append_many_async(self, payloads: list[bytes]) -> list[int]:
        return self.append_many(payloads)

    def records(self, from_seq: int = 1) -> Iterator[Record]:
        with self._lock:
            self._check_open()
            first, items = self.store.first_seq, list(self.store.records)
        if from_seq < first:
            raise WalUsageError(
                f"records before seq {first} were dropped after a snapshot; asked for "
                f"seq {from_seq} (read latest_snapshot() and then records({first}))"
            )
        return (Record(first + i, p) for i, p in enumerate(items) if first + i >= from_seq)

    def write_snapshot(self, data: bytes, seq: int | None = None) -> Snapshot:
        state = check_payload(data, MAX_RECORD_BYTES)
        with self._lock:
            self._check_open()
            seq = self.last_seq if seq is None else seq
            latest = self.latest_snapshot()
            floor = latest.seq if latest else 0
            if not floor <= seq <= self.last_seq:
                raise WalUsageError(
                    f"snapshot seq must be in {floor}..{self.last_seq} (latest snapshot..last "
                    f"durable seq), got {seq}"
                )
            snaps = [s for s in self.store.snapshots if s.seq != seq] + [Snapshot(seq, state)]
            snaps = snaps[-self.keep_snapshots :]
            drop = snaps[0].seq + 1 - self.store.first_seq  # records no kept snapshot needs
            if drop > 0:
                del self.store.records[:drop]
                self.store.first_seq += drop
            self.store.snapshots = snaps
            return snaps[-1]

    def latest_snapshot(self) -> Snapshot | None:
        return self.store.snapshots[-1] if self.store.snapshots else None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.store.is_open = False

    def __enter__(self) -> MemoryLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
