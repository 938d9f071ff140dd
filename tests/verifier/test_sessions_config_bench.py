"""The batching limits (cluster_config.schema.Limits) and the sessions bench's own logic:
refusals quote the offending values; the summary's ratios and greedy checks are exact."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cluster_config.schema import Limits
from muser.bench_sessions import format_sessions, run_sessions_bench, summarise_sessions
from muser.benchmark import Sample


def test_limits_defaults_and_refusals():
    limits = Limits()
    assert (limits.kv_sessions, limits.max_batch, limits.round_queue) == (16, 8, 64)
    with pytest.raises(ValidationError, match="max_batch 9 > kv_sessions 8"):
        Limits(kv_sessions=8, max_batch=9)
    for field in ("kv_sessions", "max_batch", "round_queue"):
        with pytest.raises(ValidationError, match=field):
            Limits(**{field: 0})
    assert Limits(kv_sessions=1, max_batch=1, round_queue=1).round_queue == 1


def sample(n: int, prompt: int, tokens: list[int], repeat: int = 0) -> Sample:
    return Sample(f"sessions={n}", prompt, repeat, tokens, 1.0, drafted=4, accepted=2, rounds=2)


def test_summary_ratio_and_greedy_match_are_exact():
    rates = {1: [100.0, 120.0, 110.0], 8: [330.0, 300.0, 360.0]}
    samples = [sample(1, 0, [1, 2]), sample(8, 0, [1, 2]), sample(8, 1, [9, 9])]
    oracle = {0: [1, 2], 1: [3, 4]}
    out = summarise_sessions(rates, samples, oracle)
    assert out["sessions=1"]["tokens_per_s"] == 110.0
    assert out["sessions=8"]["tokens_per_s"] == 330.0
    assert out["sessions=8"]["ratio_to_1"] == 3.0
    assert out["sessions=8"]["spread"] == [300.0, 360.0]
    assert out["sessions=8"]["per_session_tokens_per_s"] == 330.0 / 8
    assert out["sessions=8"]["greedy_match_plain"] == "1/2"
    assert out["sessions=1"]["acceptance"] == 0.5
    table = format_sessions(out)
    assert table.splitlines()[2].split()[:4] == ["8", "330.0", "300.0–360.0", "3.00"]


def test_sessions_bench_refuses_more_sessions_than_prompts():
    with pytest.raises(ValueError, match="8 sessions need as many prompts, got 2"):
        run_sessions_bench(lambda p, n: None, [[1], [2]], [1, 8], 4, 1, progress=False)


def test_sessions_suite_refuses_a_bad_session_count(capsys):
    from muser.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers(), "bench", "bench")
    args = parser.parse_args(["bench", "--suite", "sessions", "--sessions", "0,8"])
    assert args.func(args) == 2
    assert "--sessions '0,8': expected counts >= 1" in capsys.readouterr().err
