"""The fragment store: payload bytes named by their SHA-256 (docs/design.md §7).

    put(bytes) -> digest     idempotent: a digest already held costs no second write
    get(digest) -> bytes     re-hashes; a mismatch is FragmentCorruptError and the bad copy
                             moves to quarantine/, so a later put of the true bytes heals it
    has, missing(digests)    `missing` is the closure check: which named fragments are absent

ATOMIC WRITES (FileFragmentStore). Layout: DIR/objects/<first 2 hex>/<64 hex>, DIR/tmp/,
DIR/quarantine/. A put writes DIR/tmp/<digest>.<unique>, fsyncs it, renames it to its
object path and fsyncs the fan-out directory (and DIR/objects when the fan-out directory
is new). So an object name exists only for complete, durable bytes; a crash leaves at most
a temp file, which the next open deletes. Two puts of the same bytes race harmlessly: both
renames install identical content.

GARBAGE COLLECTION. The store does not read records, so the caller says what is live:
`gc(live)` removes a fragment only if all three hold:
  1. it is not in `live` (the digests the caller's committed records and snapshot need);
  2. no owner pins it (`pin(owner, digests)` ... `unpin(owner)`: e.g. a session pins what a
     round staged until the proposer's ack; pins live in memory, for one process lifetime);
  3. it was not put, nor named in a `missing` closure check, in the last `grace_seconds`.
Rule 3 is what protects a fragment staged for a round that has not committed yet, without
the caller pinning it: put or checked now, committed within the grace period, then live.
Fragments put before this process started count from their file's mtime.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from wal import _fs
from wal.errors import (
    FragmentCorruptError,
    FragmentMissingError,
    InvalidDigestError,
    WalClosedError,
    WalUsageError,
)

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_GRACE_SECONDS = 600.0


def check_digest(digest: object) -> str:
    """The digest, or InvalidDigestError quoting what was received."""
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise InvalidDigestError(
            f"a fragment digest is 64 lowercase hex characters (SHA-256), got {digest!r}"
        )
    return digest


def _as_bytes(data: object) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WalUsageError(f"a fragment is bytes, got {type(data).__name__}")
    return bytes(data)


class _StoreBase:
    """Pins, the closure check and gc: identical for both stores."""

    def __init__(self, grace_seconds: float, clock: Callable[[], float]) -> None:
        if grace_seconds < 0:
            raise WalUsageError(f"grace_seconds must be >= 0, got {grace_seconds}")
        self.grace_seconds = grace_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[str, set[str]] = {}
        self._touched: dict[str, float] = {}
        self._closed = False
        self.writes = 0  # fragment files (or dict entries) written; dedup shows here

    def _check_open(self) -> None:
        if self._closed:
            raise WalClosedError("the fragment store is closed")

    # subclass hooks; called with self._lock held where it matters
    def _exists(self, digest: str) -> bool:
        raise NotImplementedError

    def _born(self, digest: str) -> float:
        raise NotImplementedError

    def _remove(self, digest: str) -> None:
        raise NotImplementedError

    def digests(self) -> list[str]:
        raise NotImplementedError

    def has(self, digest: str) -> bool:
        """Plain query: does the store hold this fragment? (Does not refresh its grace.)"""
        self._check_open()
        return self._exists(check_digest(digest))

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The closure check: the named digests not held, in order, once each. Each held one
        has its grace period restarted, so gc cannot take it before the round commits."""
        self._check_open()
        now, seen, absent = self._clock(), set(), []
        for digest in digests:
            if check_digest(digest) in seen:
                continue
            seen.add(digest)
            with self._lock:
                if self._exists(digest):
                    self._touched[digest] = now
                else:
                    absent.append(digest)
        return absent

    def pin(self, owner: str, digests: Iterable[str]) -> None:
        """Keep these fragments through gc until `unpin(owner)`."""
        self._check_open()
        checked = {check_digest(d) for d in digests}
        with self._lock:
            self._pins.setdefault(owner, set()).update(checked)

    def unpin(self, owner: str) -> int:
        """Release every pin of `owner`; returns how many digests it had pinned."""
        with self._lock:
            return len(self._pins.pop(owner, ()))

    def gc(self, live: Iterable[str] = (), *, now: float | None = None) -> int:
        """Remove every fragment the three rules in the module docstring allow; count them."""
        self._check_open()
        keep = {check_digest(d) for d in live}
        now = self._clock() if now is None else now
        removed = 0
        for digest in self.digests():
            with self._lock:
                if digest in keep or any(digest in p for p in self._pins.values()):
                    continue
                if not self._exists(digest):  # gone meanwhile (get quarantined it)
                    continue
                since = self._touched.get(digest)
                if since is None:
                    since = self._born(digest)
                if now - since < self.grace_seconds:
                    continue
                self._remove(digest)
                self._touched.pop(digest, None)
                removed += 1
        self._after_removals()
        return removed

    def _after_removals(self) -> None:
        """Make the removals durable (the file store fsyncs each directory once)."""

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> _StoreBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MemoryFragmentStore(_StoreBase):
    """Fragments in a dict; the same contract as the file store."""

    def __init__(
        self,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(grace_seconds, clock)
        self._data: dict[str, bytes] = {}
        self._born_at: dict[str, float] = {}
        self.quarantined: list[tuple[str, bytes]] = []

    def put(self, data: bytes) -> str:
        self._check_open()
        blob = _as_bytes(data)
        digest = hashlib.sha256(blob).hexdigest()
        with self._lock:
            if digest not in self._data:
                self._data[digest] = blob
                self._born_at[digest] = self._clock()
                self.writes += 1
            self._touched[digest] = self._clock()
        return digest

    def get(self, digest: str) -> bytes:
        self._check_open()
        check_digest(digest)
        with self._lock:
            blob = self._data.get(digest)
            if blob is None:
                raise FragmentMissingError(f"fragment {digest} is not in the store")
            if hashlib.sha256(blob).hexdigest() != digest:
                self.quarantined.append((digest, self._data.pop(digest)))
                raise FragmentCorruptError(
                    f"fragment {digest}: stored bytes hash to "
                    f"{hashlib.sha256(blob).hexdigest()}; moved to quarantine, put it again"
                )
            return blob

    def _exists(self, digest: str) -> bool:
        return digest in self._data

    def _born(self, digest: str) -> float:
        return self._born_at[digest]

    def _remove(self, digest: str) -> None:
        del self._data[digest]
        del self._born_at[digest]

    def digests(self) -> list[str]:
        with self._lock:
            return sorted(self._data)


class FileFragmentStore(_StoreBase):
    """Fragments as files (see ATOMIC WRITES). One process per directory (DIR/LOCK)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(grace_seconds, clock)
        self.directory = Path(directory)
        self._objects = self.directory / "objects"
        self._tmp = self.directory / "tmp"
        for path in (self._objects, self._tmp):
            _fs.ensure_dir(path)
        self._dir_lock = _fs.DirLock(self.directory)
        for stale in self._tmp.iterdir():  # puts a crash interrupted: never renamed
            stale.unlink()
        self._counter = 0
        self._dirty: set[Path] = set()
        self._settled: set[str] = set()
        """Digests whose name this process saw durable (its fan-out directory fsynced after
        the rename): a put of one of them returns at once."""
        self._fanouts: set[str] = set()
        """Fan-out directories whose own entry in objects/ this process saw durable."""

    def _path(self, digest: str) -> Path:
        return self._objects / digest[:2] / digest

    def put(self, data: bytes) -> str:
        self._check_open()
        blob = _as_bytes(data)
        digest = hashlib.sha256(blob).hexdigest()
        final = self._path(digest)
        with self._lock:
            there = final.exists()
            if there:
                self._touched[digest] = self._clock()
                if digest in self._settled:
                    return digest
            else:
                self._counter += 1
                tmp = self._tmp / f"{digest}.{os.getpid()}.{self._counter}"
        if not there:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _fs.write_all(fd, blob)
                _fs.fsync_file(fd)
            finally:
                os.close(fd)
        # the name is durable only once its fan-out directory, and that directory's own entry
        # in objects/, are: a put that finds the file there (another thread renamed it and
        # has not fsynced yet, or a crash came between a rename and its fsync) makes sure of
        # both before it returns, as a put that writes it does
        self._settle_fanout(final.parent)
        if not there:
            with self._lock:
                os.replace(tmp, final)
                self._touched[digest] = self._clock()
                self.writes += 1
        _fs.fsync_dir(final.parent)
        with self._lock:
            self._settled.add(digest)
        return digest

    def _settle_fanout(self, fanout: Path) -> None:
        if fanout.name in self._fanouts:
            return
        fanout.mkdir(exist_ok=True)
        _fs.fsync_dir(self._objects)
        with self._lock:
            self._fanouts.add(fanout.name)

    def get(self, digest: str) -> bytes:
        self._check_open()
        path = self._path(check_digest(digest))
        try:
            blob = path.read_bytes()
        except FileNotFoundError as exc:
            raise FragmentMissingError(f"fragment {digest} is not in {self.directory}") from exc
        actual = hashlib.sha256(blob).hexdigest()
        if actual != digest:
            moved = self._quarantine(digest)
            raise FragmentCorruptError(
                f"fragment {path}: stored bytes hash to {actual}, not to its name; moved to "
                f"{moved}, put the fragment again"
            )
        return blob

    def _quarantine(self, digest: str) -> Path:
        qdir = self.directory / "quarantine"
        _fs.ensure_dir(qdir)
        with self._lock:
            self._counter += 1
            target = qdir / f"{digest}.{int(time.time())}.{self._counter}"
            os.replace(self._path(digest), target)
            self._touched.pop(digest, None)
            self._settled.discard(digest)
        _fs.fsync_dir(self._path(digest).parent)
        _fs.fsync_dir(qdir)
        return target

    def _exists(self, digest: str) -> bool:
        return self._path(digest).exists()

    def _born(self, digest: str) -> float:
        return self._path(digest).stat().st_mtime

    def _remove(self, digest: str) -> None:
        path = self._path(digest)
        path.unlink()
        self._settled.discard(digest)
        self._dirty.add(path.parent)

    def _after_removals(self) -> None:
        for fanout in sorted(self._dirty):
            _fs.fsync_dir(fanout)
        self._dirty.clear()

    def digests(self) -> list[str]:
        self._check_open()
        return sorted(
            p.name
            for fanout in self._objects.iterdir()
            for p in fanout.iterdir()
            if DIGEST_RE.match(p.name)
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._dir_lock.release()
