"""Fixtures of the wal tests: the two implementations behind one contract, the CLI runner."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

from wal.fragments import FileFragmentStore, MemoryFragmentStore
from wal.log import FileLog
from wal.memory import MemoryLog, MemoryLogStore

HERE = str(Path(__file__).resolve().parent)  # toy_rounds, the CLI tests' --interpreter
if HERE not in sys.path:
    sys.path.append(HERE)


@pytest.fixture(autouse=True)
def wal_alone(monkeypatch):
    """The wal tests test the log and its hook on their own: no daemon interpreters."""
    from muser_app.cli import wal as cli_wal
    from wal import interpret

    monkeypatch.setattr(cli_wal, "DAEMON_INTERPRETERS", ())
    monkeypatch.setattr(interpret, "_registry", [])


class LogEnv:
    """Opens (and reopens) one log of the kind under test on the same backing storage."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.directory = tmp_path / "log"
        self.store = MemoryLogStore()
        self.opened: list = []

    def open(self, **options):
        if self.kind == "memory":
            options.pop("segment_bytes", None)
            log = MemoryLog(self.store, **options)
        else:
            log = FileLog(self.directory, **options)
        self.opened.append(log)
        return log

    def close_all(self) -> None:
        for log in self.opened:
            log.close()


@pytest.fixture(params=["memory", "file"])
def log_env(request, tmp_path):
    env = LogEnv(request.param, tmp_path)
    yield env
    env.close_all()


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class StoreEnv:
    """Opens a fragment store of the kind under test, and corrupts a fragment in it."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.directory = tmp_path / "fragments"
        self.clock = FakeClock()
        self.stores: list = []

    def open(self, **options):
        options.setdefault("clock", self.clock)
        if self.kind == "memory":
            store = MemoryFragmentStore(**options)
        else:
            store = FileFragmentStore(self.directory, **options)
        self.stores.append(store)
        return store

    def corrupt(self, store, digest: str, data: bytes) -> None:
        if self.kind == "memory":
            store._data[digest] = data
        else:
            (self.directory / "objects" / digest[:2] / digest).write_bytes(data)

    def close_all(self) -> None:
        for store in self.stores:
            store.close()


@pytest.fixture(params=["memory", "file"])
def store_env(request, tmp_path):
    env = StoreEnv(request.param, tmp_path)
    yield env
    env.close_all()


@pytest.fixture
def run_cli(monkeypatch):
    """Run `muser wal ...` through the real dispatcher; returns (exit code, stdout, stderr).

    Only the wal subcommand is registered, so this test does not depend on the modules
    other subcommands need."""
    import muser_app.cli.main as cli_main

    monkeypatch.setattr(cli_main, "SUBCOMMANDS", {"wal": cli_main.SUBCOMMANDS["wal"]})

    def run(*argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main.main(["wal", *map(str, argv)])
        return code, out.getvalue(), err.getvalue()

    return run
