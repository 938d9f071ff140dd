"""A snapshot cut short: copies of a log's directory at each step a crash could stop it at
(wal/log.py, FSYNC RULES: snapshot)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from wal import _fs


@contextlib.contextmanager
def copies_at_each_step(root: Path, log_dir: Path, out: Path) -> Iterator[list[Path]]:
    """While inside, each step of a snapshot written in `log_dir` leaves a copy of `root`
    (the daemon's WAL directory, which holds it) under `out`: the temp snapshot written and
    synced but not in place, then in place with no covered segment dropped, then after each
    covered segment is unlinked. Yields the list the copies are added to."""
    states: list[Path] = []

    def keep() -> None:
        states.append(shutil.copytree(root, out / f"crash{len(states)}"))

    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src, dst):
        keep()
        real_replace(src, dst)
        keep()

    def unlink(path, missing_ok=False):
        real_unlink(path, missing_ok=missing_ok)
        if path.parent == log_dir:
            keep()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_fs.os, "replace", replace)
        patch.setattr(Path, "unlink", unlink)
        yield states
