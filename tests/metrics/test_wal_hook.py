"""FileLog(on_fsync=...) reports each commit and rollover fsync with its duration."""

from __future__ import annotations

import threading

from muser.stats import DaemonStats
from wal.log import FileLog


def test_on_fsync_sees_every_commit_and_rollover_fsync(tmp_path):
    seen: list[tuple[float, str]] = []
    with FileLog(
        tmp_path / "log",
        segment_bytes=64,
        on_fsync=lambda s: seen.append((s, threading.current_thread().name)),
    ) as log:
        for i in range(3):
            log.append(b"r%029d" % i)  # 24-byte header + a 50-byte record > 64
    # three lone appends fsync once each; segment_bytes=64 seals the segment before each
    # later append (one more fsync each)
    assert len(seen) == 5
    assert all(s >= 0.0 for s, _ in seen)


def test_daemon_stats_observe_fsync_from_the_flusher(tmp_path):
    stats = DaemonStats()
    with FileLog(tmp_path / "log", on_fsync=stats.observe_fsync) as log:
        threads = [threading.Thread(target=lambda i=i: log.append(b"x%d" % i)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert 1 <= stats.fsync.count <= 8  # group commit may share fsyncs
    assert stats.fsync.cumulative()[-1][1] == stats.fsync.count
    assert stats.fsync.quantile(0.99) is not None
