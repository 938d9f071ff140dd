"""The benchmark runs end to end at a tiny size and returns every raw sample (not a speed test)."""

from __future__ import annotations

from wal.bench import format_wal_bench, run_wal_bench


def test_bench_returns_raw_samples_and_a_table(tmp_path):
    result = run_wal_bench(tmp_path, records=64, progress=False)
    assert len(result["single"]["samples_ms"]) == 64
    assert [c["appenders"] for c in result["concurrent"]] == [1, 8, 64]
    assert [c["records"] for c in result["concurrent"]] == [64, 64, 64]
    assert [len(c["samples_ms"]) for c in result["concurrent"]] == [64, 64, 64]
    assert all(c["fsyncs"] >= 1 for c in result["concurrent"])
    assert result["concurrent"][0]["fsyncs"] == 64  # one appender: one fsync per record
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # it cleans up after itself
    table = format_wal_bench(result)
    assert table.splitlines()[0] == "wal bench: 512-byte records, 64 per run"
    assert len(table.splitlines()) == 8
