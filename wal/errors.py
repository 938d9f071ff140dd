"""Errors of the storage layer (commit log, fragment store).

Each subclasses `MuserError`, the base of every error the project raises on purpose, so the
CLI maps it to an exit code and the servicers to one gRPC status. That base is defined here,
in the lowest layer, because storage imports nothing above it (docs/architecture.md);
`muser.errors` re-exports it for everything else. Corruption is a refusal (exit 2): the data
on disk is input the daemon will not use until an operator acts, and the message says which
command to run.
"""

from __future__ import annotations

from pathlib import Path


class MuserError(Exception):
    """Base of every error this project raises on purpose (re-exported by `muser.errors`)."""

    exit_code = 3


class WalError(MuserError):
    """Base of the storage errors; a plain runtime failure unless a subclass says otherwise."""

    exit_code = 3


class WalCorruptionError(WalError):
    """A file of the log holds a bad record (or header) that a crash cannot explain.

    Carries the file and the byte offset of the first bad byte range, so the message and the
    repair tool agree on where good data ends.
    """

    exit_code = 2

    def __init__(self, path: Path, offset: int, reason: str, directory: Path) -> None:
        self.path = Path(path)
        self.offset = offset
        self.reason = reason
        self.directory = Path(directory)
        super().__init__(
            f"{self.path}: corrupt at byte offset {offset}: {reason}. The log refuses to "
            f"open; run `muser wal repair {self.directory}` to keep every record before "
            f"this point and move the rest into {self.directory / 'quarantine'}/"
        )


class WalVersionError(WalError):
    """A file carries a format version this build cannot read (never repaired away)."""

    exit_code = 2


class WalLockedError(WalError):
    """Another writer holds the directory lock."""

    exit_code = 2


class WalUsageError(WalError):
    """A call the log refuses: bad payload type or size, sequence number out of range."""

    exit_code = 2


class WalClosedError(WalError):
    """The log (or store) was closed; nothing more is written."""


class WalIOError(WalError):
    """A write or fsync failed. The log is poisoned: after a failed fsync the page cache can
    no longer be trusted, so every later append refuses until the log is reopened."""


class FragmentError(WalError):
    """Base of the fragment store errors."""

    exit_code = 2


class InvalidDigestError(FragmentError):
    """A digest is not 64 lowercase hex characters (SHA-256)."""


class FragmentMissingError(FragmentError):
    """`get` of a digest the store does not hold."""


class FragmentCorruptError(FragmentError):
    """A stored fragment's bytes no longer hash to its name; it was moved to quarantine."""
