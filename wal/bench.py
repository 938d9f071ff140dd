"""Commit-log benchmark: single-appender commit latency and group-commit throughput.

Not a test. `run_wal_bench(dir)` measures, with 512-byte records:
- the disk's own write+fdatasync cost (the floor every durable append pays);
- single-appender commit latency (p50/p99 ms of `append`, which returns only once durable);
- records/s with 1, 8 and 64 appender threads, and how many records each fsync carried.
Every raw sample is in the result, so a receipt can hash them.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from wal import _fs
from wal.log import FileLog

RECORD_BYTES = 512
APPENDERS = (1, 8, 64)
GOALS = {"single_p50_ms": 0.5, "records_per_s_at_64": 20_000}


def _percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(samples)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def _summary(samples_ms: list[float]) -> dict:
    return {
        "p50_ms": _percentile(samples_ms, 50),
        "p99_ms": _percentile(samples_ms, 99),
        "mean_ms": sum(samples_ms) / len(samples_ms),
        "samples_ms": samples_ms,
    }


def _fresh(directory: Path, name: str) -> Path:
    path = directory / name
    shutil.rmtree(path, ignore_errors=True)
    return path


def _raw_fsync(directory: Path, count: int) -> dict:
    path = directory / "raw-fsync"
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "file", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    block, samples = b"r" * (RECORD_BYTES + 20), []
    try:
        for _ in range(count):
            start = time.perf_counter()
            os.write(fd, block)
            _fs.fsync_file(fd)
            samples.append((time.perf_counter() - start) * 1e3)
    finally:
        os.close(fd)
        shutil.rmtree(path)
    return _summary(samples)


def _single(directory: Path, records: int) -> dict:
    payload, samples = os.urandom(RECORD_BYTES), []
    with FileLog(_fresh(directory, "single")) as log:
        for _ in range(20):  # warm up: segment creation, page cache, code paths
            log.append(payload)
        for _ in range(records):
            start = time.perf_counter()
            log.append(payload)
            samples.append((time.perf_counter() - start) * 1e3)
    return _summary(samples)


def _concurrent(directory: Path, appenders: int, records: int) -> dict:
    per_thread = max(1, records // appenders)
    payload = os.urandom(RECORD_BYTES)
    samples: list[list[float]] = [[] for _ in range(appenders)]
    barrier = threading.Barrier(appenders + 1)

    def appender(mine: list[float]) -> None:
        barrier.wait()
        for _ in range(per_thread):
            start = time.perf_counter()
            log.append(payload)
            mine.append((time.perf_counter() - start) * 1e3)

    with FileLog(_fresh(directory, f"threads-{appenders}")) as log:
        log.append(payload)
        threads = [threading.Thread(target=appender, args=(s,)) for s in samples]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        batches_before = log._group.batches
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        fsyncs = log._group.batches - batches_before
    total = per_thread * appenders
    flat = [x for s in samples for x in s]
    return {
        "appenders": appenders,
        "records": total,
        "seconds": seconds,
        "records_per_s": total / seconds,
        "fsyncs": fsyncs,
        "records_per_fsync": total / max(1, fsyncs),
        **_summary(flat),
    }


def run_wal_bench(directory: Path, *, records: int = 4000, progress: bool = True) -> dict:
    """Run every measurement in `directory` (created, and emptied of what it made)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    phases = ["disk fsync", "single appender", *(f"{n} appenders" for n in APPENDERS)]
    bar = tqdm(phases, desc="wal bench", disable=not progress, leave=False)
    try:  # progress per phase: a per-record tick would contend with the appenders
        bar.set_postfix_str(phases[0])
        raw = _raw_fsync(directory, min(records, 500))
        bar.update()
        bar.set_postfix_str(phases[1])
        single = _single(directory, records)
        bar.update()
        concurrent = []
        for n, phase in zip(APPENDERS, phases[2:], strict=True):
            bar.set_postfix_str(phase)
            concurrent.append(_concurrent(directory, n, records))
            bar.update()
    finally:
        bar.close()
        for name in ["single", *(f"threads-{n}" for n in APPENDERS)]:
            shutil.rmtree(directory / name, ignore_errors=True)
    at_64 = next(c for c in concurrent if c["appenders"] == 64)
    return {
        "record_bytes": RECORD_BYTES,
        "records": records,
        "directory": str(directory),
        "raw_fsync": raw,
        "single": single,
        "concurrent": concurrent,
        "goals": dict(GOALS),
        "met": {
            "single_p50_ms": single["p50_ms"] <= GOALS["single_p50_ms"],
            "records_per_s_at_64": at_64["records_per_s"] >= GOALS["records_per_s_at_64"],
        },
    }


def format_wal_bench(result: dict) -> str:
    """A compact table of a `run_wal_bench` result."""
    raw, single = result["raw_fsync"], result["single"]
    lines = [
        f"wal bench: {result['record_bytes']}-byte records, {result['records']} per run",
        f"  disk write+fsync      p50 {raw['p50_ms']:.3f} ms   p99 {raw['p99_ms']:.3f} ms",
        f"  single-appender commit p50 {single['p50_ms']:.3f} ms   p99 {single['p99_ms']:.3f} ms"
        f"   (goal p50 <= {result['goals']['single_p50_ms']} ms: "
        f"{'met' if result['met']['single_p50_ms'] else 'MISSED'})",
        "  appenders   records/s   records/fsync   p50 ms   p99 ms",
    ]
    for row in result["concurrent"]:
        lines.append(
            f"  {row['appenders']:>9}   {row['records_per_s']:>9.0f}   "
            f"{row['records_per_fsync']:>13.1f}   {row['p50_ms']:>6.3f}   {row['p99_ms']:>6.3f}"
        )
    goal = result["goals"]["records_per_s_at_64"]
    met = "met" if result["met"]["records_per_s_at_64"] else "MISSED"
    lines.append(f"  (goal at 64 appenders >= {goal} records/s: {met})")
    return "\n".join(lines)
