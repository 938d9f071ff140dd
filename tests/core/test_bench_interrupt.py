"""A bench stopped by Ctrl-C or SIGTERM (a `timeout`) keeps the runs it finished: the table,
and a receipt marked `interrupted`, exit 130."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

from muser_app.bench.run import run_bench
from muser_app.bench.sample import Sample
from muser_app.bench.sessions import run_sessions_bench


def sample(tokens: int = 4) -> Sample:
    return Sample("x", 0, 0, list(range(tokens)), 0.01, 0, 0, tokens, {})


def lane_interrupted_at(call: int):
    """A lane whose `call`-th call (counting the warm-up) is interrupted."""
    calls = []

    def run(prompt, max_tokens):
        calls.append(prompt)
        if len(calls) == call:
            raise KeyboardInterrupt
        return sample(max_tokens)

    return run


def test_run_bench_keeps_the_runs_finished_before_an_interrupt():
    lanes = {"a": lane_interrupted_at(5), "b": lane_interrupted_at(99)}
    samples = run_bench(lanes, [[1, 2], [3, 4]], 4, repeats=3, progress=False)
    # warm-ups, then per (repeat, prompt) a b | b a | b a | a: a's 5th call is interrupted
    assert [(s.lane, s.prompt, s.repeat) for s in samples] == [
        ("a", 0, 0), ("b", 0, 0), ("b", 1, 0), ("a", 1, 0), ("b", 0, 1), ("a", 0, 1),
    ]  # fmt: skip


def test_run_sessions_bench_drops_the_counts_it_never_finished():
    samples, rates = run_sessions_bench(
        lane_interrupted_at(4), [[1], [2]], [1, 2], 4, repeats=2, progress=False
    )
    # warm-up, N=1 (1 call), N=2 (2 calls: the second is interrupted, the run is dropped)
    assert list(rates) == ["sessions=1"] and len(rates["sessions=1"]) == 1
    assert [s.lane for s in samples] == ["sessions=1"]


def test_sigterm_writes_a_partial_receipt_and_exits_130(tmp_path):
    receipt = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "muser_app.cli.main", "bench", "--prompts", "1", "--max-tokens", "4"]
        + ["--repeats", "100000", "--cluster-delays", "", "--no-peers"]
        + ["--receipt", str(receipt)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    seen, deadline = b"", time.monotonic() + 300
    while not re.search(rb"bench: .*\| +[1-9]\d*/200000", seen):  # runs are being done
        assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
        seen += proc.stderr.read1(4096)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen + err)[-2000:]
    data = json.loads(receipt.read_text())
    done = len(data["samples"])
    assert 1 <= done < 200000
    assert data["meta"]["interrupted"] == f"stopped after {done} of 200000 runs"
    assert f"INTERRUPTED: stopped after {done} of 200000 runs" in out.decode()
    assert set(data["summary"]) <= {"plain", "local"} and data["summary"]
