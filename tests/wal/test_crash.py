"""Crash testing with real processes: SIGKILL a writer at random points, reopen, check.

The writer (wal/_crash_writer.py) prints "seq run thread counter" after each append
returned. After every kill the parent reopens the directory and checks: every acknowledged
record is present with its exact bytes; every visible record is one the writer made, whole
(nothing partial is visible); seqs are contiguous; history seen after earlier kills is
unchanged; the snapshot accounts for exactly the records before it. The next run appends on
top, so "appends continue" is checked by every iteration after the first.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wal import FileLog
from wal._crash_writer import parse_payload, unpack_ids

ROOT = Path(__file__).resolve().parents[2]
SEGMENT_BYTES = 16384


class Writer:
    """One writer process and the acknowledgements it managed to print before dying."""

    def __init__(
        self,
        directory: Path,
        run: int,
        threads: int,
        snapshot_every: int,
        split: bool,
        stall_at: int = 0,
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wal._crash_writer",
                str(directory),
                f"--run={run}",
                f"--threads={threads}",
                f"--segment-bytes={SEGMENT_BYTES}",
                f"--snapshot-every={snapshot_every}",
                *(["--split-writes"] if split else []),
                f"--stall-at={stall_at}",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.acks: dict[int, tuple[int, int, int]] = {}
        self.first_ack = threading.Event()
        self.stalled = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.endswith(b"\n"):  # cut short by the kill: not an acknowledgement
                break
            if line == b"stall\n":
                self.stalled.set()
                continue
            seq, run, thread, counter = map(int, line.split())
            self.acks[seq] = (run, thread, counter)
            self.first_ack.set()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        stderr = self.proc.stderr.read().decode()
        self.proc.stderr.close()
        self.proc.stdout.close()
        assert self.proc.returncode == -signal.SIGKILL, stderr


def check_log(directory: Path, acked: dict, seen: dict) -> bool:
    """Reopen and check everything the module docstring lists; True if a tail was torn."""
    with FileLog(directory, segment_bytes=SEGMENT_BYTES) as log:
        snap = log.latest_snapshot()
        ids = unpack_ids(snap.data) if snap else []
        assert len(ids) == (snap.seq if snap else 0)
        start = len(ids) + 1
        for record in log.records(start):
            assert record.seq == len(ids) + 1
            ids.append(parse_payload(record.payload))  # raises on a partial/altered record
        assert len(set(ids)) == len(ids), "a record is visible twice"
        assert log.last_seq == len(ids)
        for seq, ident in acked.items():
            assert seq <= len(ids), f"acknowledged seq {seq} lost (log ends at {len(ids)})"
            assert ids[seq - 1] == ident, f"seq {seq} holds {ids[seq - 1]}, acked {ident}"
        for seq, ident in seen.items():
            assert ids[seq - 1] == ident, f"seq {seq} changed after a later crash"
        seen.update({seq: ident for seq, ident in enumerate(ids, start=1)})
        return log.recovery.torn_tail is not None


def crash_sweep(directory: Path, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    acked: dict[int, tuple[int, int, int]] = {}
    seen: dict[int, tuple[int, int, int]] = {}
    torn = 0
    stalls = 0
    for run in range(kills):
        threads = (1, 4, 16)[run % 3]
        stall_at = rng.randrange(1, 30) if run % 5 == 4 else 0
        split = run % 2 == 1
        writer = Writer(directory, run, threads, rng.choice((0, 25, 60)), split, stall_at)
        if stall_at:
            assert writer.stalled.wait(timeout=60), "the writer never reached its stall"
            stalls += 1
        elif rng.random() < 0.15:
            time.sleep(rng.uniform(0.0, 0.15))  # may land in interpreter start or recovery
        else:
            assert writer.first_ack.wait(timeout=60), "the writer never acknowledged"
            time.sleep(rng.uniform(0.0, 0.04))
        writer.kill()
        acked.update(writer.acks)
        tore = check_log(directory, acked, seen)
        torn += tore
        if stall_at:
            assert tore, "a kill inside a record must leave a torn tail"
    with FileLog(directory, segment_bytes=SEGMENT_BYTES) as log:
        last = log.last_seq
        assert log.append(b"after the last crash") == last + 1
    return {"acked": len(acked), "seen": len(seen), "torn": torn, "stalls": stalls}


def test_sigkill_at_30_random_points_loses_no_acknowledged_record(tmp_path):
    stats = crash_sweep(tmp_path / "log", kills=30, seed=1234)
    assert stats["acked"] > 30
    assert stats["torn"] >= stats["stalls"] == 6


@pytest.mark.slow
def test_sigkill_at_300_random_points_loses_no_acknowledged_record(tmp_path):
    stats = crash_sweep(tmp_path / "log", kills=300, seed=98765)
    assert stats["acked"] > 300
    assert stats["torn"] >= stats["stalls"] == 60


def test_writer_killed_before_any_append_leaves_an_openable_log(tmp_path):
    writer = Writer(tmp_path / "log", run=0, threads=1, snapshot_every=0, split=False)
    writer.kill()
    assert writer.acks == {}
    os.makedirs(tmp_path / "log", exist_ok=True)
    with FileLog(tmp_path / "log") as log:
        assert log.append(b"x") == log.last_seq
