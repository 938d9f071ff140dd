"""The storage interfaces both daemons program against, and the plain values they return.

Two implementations of each (memory, file) pass one contract test suite
(tests/wal/test_log_contract.py, tests/wal/test_fragments_contract.py), so a daemon test can
swap the file log for the memory one without changing what it asserts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable


class Record(NamedTuple):
    """One committed record: its sequence number and its opaque payload."""

    seq: int
    payload: bytes


class Snapshot(NamedTuple):
    """Opaque daemon state that accounts for every record with seq <= `seq`."""

    seq: int
    data: bytes


@dataclass(frozen=True)
class TornTail:
    """A partial last record that open truncated (what a crash mid-append leaves)."""

    segment: str
    offset: int
    dropped_bytes: int
    reason: str


@dataclass(frozen=True)
class RecoveryReport:
    """What open found and did. `torn_tail` is None when the log ended cleanly."""

    snapshot_seq: int  # 0 when there is no snapshot
    last_seq: int
    segments_scanned: int
    records_scanned: int
    torn_tail: TornTail | None


@runtime_checkable
class CommitLog(Protocol):
    """An append-only log of opaque records with group-committed durability.

    Sequence numbers start at 1 and increase by exactly one per record. `append` returns only
    once the record (and every record before it) is durable.
    """

    recovery: RecoveryReport

    @property
    def last_seq(self) -> int:
        """Seq of the last durable record (0 when none was ever written)."""
        ...

    @property
    def first_seq(self) -> int:
        """Seq of the first record still readable; `last_seq + 1` when none is."""
        ...

    def append(self, payload: bytes) -> int:
        """Append one record; block until it is durable; return its seq. Thread-safe."""
        ...

    def append_many(self, payloads: list[bytes]) -> list[int]:
        """Append records together, in order (consecutive seqs); block until all are
        durable; return their seqs. Thread-safe."""
        ...

    async def append_async(self, payload: bytes) -> int:
        """As `append`, awaiting the group fsync without blocking the event loop."""
        ...

    async def append_many_async(self, payloads: list[bytes]) -> list[int]:
        """As `append_many`, awaiting the group fsync without blocking the event loop."""
        ...

    def records(self, from_seq: int = 1) -> Iterator[Record]:
        """Durable records with seq >= from_seq, in order. Refuses from_seq < first_seq."""
        ...

    def write_snapshot(self, data: bytes, seq: int | None = None) -> Snapshot:
        """Record state covering seq <= `seq` (default: last_seq); lets older records go."""
        ...

    def latest_snapshot(self) -> Snapshot | None: ...

    def close(self) -> None: ...


@runtime_checkable
class FragmentStore(Protocol):
    """Content-addressed bytes named by their SHA-256 (lowercase hex).

    Garbage collection: `gc(live)` removes a fragment only when it is (1) not in `live`, the
    digests the caller's committed records need, (2) not pinned by any owner, and (3) not put
    or named in a `missing` closure check within the last `grace_seconds`. Rule (3) is what
    keeps a fragment staged for a round that has not committed yet; pins are the explicit
    form of the same (e.g. pinned by a session until the proposer's ack).
    """

    def put(self, data: bytes) -> str: ...

    def get(self, digest: str) -> bytes: ...

    def has(self, digest: str) -> bool: ...

    def missing(self, digests: Iterable[str]) -> list[str]: ...

    def pin(self, owner: str, digests: Iterable[str]) -> None: ...

    def unpin(self, owner: str) -> int: ...

    def gc(self, live: Iterable[str] = (), *, now: float | None = None) -> int: ...

    def digests(self) -> list[str]: ...

    def close(self) -> None: ...
