"""Durable storage for both daemons (docs/design.md §6-§7).

- the commit log: `FileLog` (format spec and fsync rules drawn in wal/log.py) and
  `MemoryLog`, both a `CommitLog`; group-committed `append` / `append_async`, recovery that
  truncates a torn tail and refuses corruption, snapshots that bound recovery time;
- the fragment store: `FileFragmentStore` and `MemoryFragmentStore`, both a
  `FragmentStore`: content-addressed by SHA-256, atomic writes, pins and a gc with a grace
  period (rules in wal/fragments.py);
- `repair_log` (wal/repair.py), `inspect_log` / `verify_log` (wal/tools.py) behind
  `muser wal`, and the `RecordInterpreter` hook through which they understand round
  records (wal/interpret.py).
"""

from wal.base import CommitLog, FragmentStore, Record, RecoveryReport, Snapshot, TornTail
from wal.errors import (
    FragmentCorruptError,
    FragmentError,
    FragmentMissingError,
    InvalidDigestError,
    WalClosedError,
    WalCorruptionError,
    WalError,
    WalIOError,
    WalLockedError,
    WalUsageError,
    WalVersionError,
)
from wal.fragments import FileFragmentStore, MemoryFragmentStore
from wal.interpret import RecordInterpreter, register_interpreter, unregister_interpreter
from wal.log import FileLog
from wal.memory import MemoryLog, MemoryLogStore
from wal.repair import RepairReport, repair_log
from wal.tools import VerifyResult, inspect_log, verify_log

__all__ = [
    "CommitLog",
    "FileFragmentStore",
    "FileLog",
    "FragmentCorruptError",
    "FragmentError",
    "FragmentMissingError",
    "FragmentStore",
    "InvalidDigestError",
    "MemoryFragmentStore",
    "MemoryLog",
    "MemoryLogStore",
    "Record",
    "RecordInterpreter",
    "RecoveryReport",
    "RepairReport",
    "Snapshot",
    "TornTail",
    "VerifyResult",
    "WalClosedError",
    "WalCorruptionError",
    "WalError",
    "WalIOError",
    "WalLockedError",
    "WalUsageError",
    "WalVersionError",
    "inspect_log",
    "register_interpreter",
    "repair_log",
    "unregister_interpreter",
    "verify_log",
]
