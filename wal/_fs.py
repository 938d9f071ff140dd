"""Filesystem primitives with the durability rules of the storage layer in one place.

`fsync_file` is what "durable" means for file data: `fdatasync` on Linux (the file size is
part of the data it flushes), `F_FULLFSYNC` on macOS (plain fsync there does not flush the
drive cache). `fsync_dir` makes a create, rename or unlink in a directory durable. Tests
patch these two names to inject failures.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path

from wal.errors import WalLockedError


def fsync_file(fd: int) -> None:
    """Flush a file's data (and size) to stable storage."""
    if sys.platform == "darwin" and hasattr(fcntl, "F_FULLFSYNC"):
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    elif hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:
        os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (creates, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write is legal for regular files)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` so that it holds either nothing or all of `data`, durably.

    temp file in the same directory, write, fsync, rename over `path`, fsync directory.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        fsync_file(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def ensure_dir(path: Path) -> None:
    """mkdir -p, fsyncing each parent whose entry we created."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for created in reversed(missing):
        created.mkdir(exist_ok=True)
        fsync_dir(created.parent)


class DirLock:
    """An exclusive advisory lock on `DIR/LOCK`, so two writers never share a log.

    flock is released by the kernel when the process dies (SIGKILL included), so a crashed
    writer never leaves a stale lock behind.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / "LOCK"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WalLockedError(
                    f"{directory} is locked by another writer (flock on {self.path}); "
                    "stop the other process or open a different directory"
                ) from exc
            raise

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1
