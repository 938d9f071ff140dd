"""The batching limits (cluster_config.schema.Limits) and the sessions bench's own logic:
refusals quote the offending values; the summary's ratios and greedy checks are exact; a
variant's waves run beside the base cluster's, and its paired ratio is exact."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster_config.schema import Limits
from muser_app.bench.sample import Sample
from muser_app.bench.sessions import (
    format_sessions,
    label,
    parse_label,
    run_sessions_bench,
    summarise_sessions,
)


def test_limits_defaults_and_refusals():
    limits = Limits()
    assert (limits.kv_sessions, limits.max_batch, limits.round_queue) == (16, 8, 64)
    with pytest.raises(ValidationError, match="max_batch 9 > kv_sessions 8"):
        Limits(kv_sessions=8, max_batch=9)
    for field in ("kv_sessions", "max_batch", "round_queue"):
        with pytest.raises(ValidationError, match=field):
            Limits(**{field: 0})
    assert Limits(kv_sessions=1, max_batch=1, round_queue=1).round_queue == 1


def sample(n: int, prompt: int, tokens: list[int], repeat: int = 0, variant: str = "") -> Sample:
    lane = label(n, variant)
    return Sample(lane, prompt, repeat, tokens, 1.0, drafted=4, accepted=2, rounds=2)


def test_summary_ratio_and_greedy_match_are_exact():
    rates = {"sessions=1": [100.0, 120.0, 110.0], "sessions=8": [330.0, 300.0, 360.0]}
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


def test_a_variants_rows_carry_the_paired_ratio_to_the_base_cluster():
    rates = {
        "sessions=1": [100.0, 200.0, 100.0],
        "sessions=8": [300.0, 500.0, 310.0],
        "sessions=1[b1]": [110.0, 180.0, 120.0],
        "sessions=8[b1]": [330.0, 450.0, 372.0],
    }
    samples = [sample(n, 0, [1, 2], r, v) for n in (1, 8) for r in range(3) for v in ("", "b1")]
    out = summarise_sessions(rates, samples, None)
    assert list(out) == ["sessions=1", "sessions=8", "sessions=1[b1]", "sessions=8[b1]"]
    row = out["sessions=8[b1]"]
    assert (row["sessions"], row["variant"]) == (8, "b1")
    assert row["ratio_to_base"] == pytest.approx(1.1)  # median of 1.1, 0.9, 1.2 (the repeats')
    assert row["ratio_to_1"] == 372.0 / 120.0  # within its own cluster, as for the base
    assert out["sessions=1[b1]"]["ratio_to_base"] == pytest.approx(1.1)
    assert "ratio_to_base" not in out["sessions=8"] and out["sessions=8"]["variant"] is None
    lines = format_sessions(out).splitlines()
    assert "×base" in lines[0]
    assert lines[4].split()[:4] == ["8[b1]", "372.0", "330.0–450.0", "3.10"]
    assert lines[4].split()[7] == "1.10" and lines[2].split()[7] == "-"


def test_a_label_names_the_wave_and_its_cluster():
    assert (label(8), label(8, "b1")) == ("sessions=8", "sessions=8[b1]")
    assert parse_label("sessions=8[b1]") == (8, "b1") and parse_label("sessions=1") == (1, "")


def test_each_wave_runs_on_every_cluster_in_turn():
    """The variant's wave of each N and repeat runs right beside the base cluster's, the
    two alternating which goes first."""
    ran = []

    def lane_of(name):
        def lane(prompt, max_tokens):
            ran.append(name)
            return Sample("cluster", 0, 0, [1] * max_tokens, 0.1, 4, 2, 2)

        return lane

    samples, rates = run_sessions_bench(
        lane_of("base"), [[1], [2]], [1, 2], 3, 2, progress=False, variants={"v": lane_of("v")}
    )
    waves = ran[2:]  # after one warm-up call each
    assert ran[:2] == ["base", "v"]
    # repeat 0: N=1 base then v, N=2 v then base; repeat 1 (N reversed): N=2 v, base; N=1 ...
    assert waves == ["base", "v", "v", "v", "base", "base"] + [
        "v",
        "v",
        "base",
        "base",
        "base",
        "v",
    ]
    assert sorted(rates) == ["sessions=1", "sessions=1[v]", "sessions=2", "sessions=2[v]"]
    assert all(len(r) == 2 for r in rates.values())
    assert {s.lane for s in samples} == set(rates)


def test_sessions_bench_refuses_more_sessions_than_prompts():
    with pytest.raises(ValueError, match="8 sessions need as many prompts, got 2"):
        run_sessions_bench(lambda p, n: None, [[1], [2]], [1, 8], 4, 1, progress=False)


def test_cpu_per_session_round_counts_each_wave_once():
    """A wave's daemon CPU rides on each of its runs; it is summed once per wave and divided
    by all the rounds of the waves."""

    def run(repeat, prompt, cpu):
        s = sample(8, prompt, [1, 2], repeat)
        s.split_s = {"run_wall": 1.0, **cpu}
        return s

    wave0 = {"run_cpu_proposer": 0.010, "run_cpu_verifier": 0.006}
    wave1 = {"run_cpu_proposer": 0.014, "run_cpu_verifier": 0.010}
    samples = [run(0, 0, wave0), run(0, 1, wave0), run(1, 0, wave1), run(1, 1, wave1)]
    out = summarise_sessions({"sessions=8": [300.0, 330.0]}, samples, None)
    cpu = out["sessions=8"]["cpu_ms_per_session_round"]
    assert cpu == pytest.approx({"proposer": 3.0, "verifier": 2.0})  # 24 ms, 16 ms over 8 rounds
    assert format_sessions(out).splitlines()[1].endswith("proposer 3.00  verifier 2.00")
    for s in samples[2:]:  # a wave without the verifier's reading: the verifier is left out
        s.split_s.pop("run_cpu_verifier")
    out = summarise_sessions({"sessions=8": [300.0]}, samples, None)
    cpu = out["sessions=8"]["cpu_ms_per_session_round"]
    assert list(cpu) == ["proposer"]


def test_a_pinned_clusters_rows_get_the_bound_of_its_busiest_core():
    """N sessions' rounds share the daemons' cores: at most 1000 / (busiest core's CPU ms per
    session-round) session-rounds a second, each emitting the row's tokens per round."""

    def run(n, repeat, prompt, cpu, variant=""):
        s = sample(n, prompt, [1, 2, 3, 4], repeat, variant)  # 4 tokens in 2 rounds
        s.split_s = {"run_wall": 1.0, **cpu}
        return s

    cpu = {"run_cpu_proposer": 0.010, "run_cpu_verifier": 0.008}  # a wave: 10 and 8 ms
    samples = [run(1, 0, 0, cpu), run(8, 0, 0, cpu), run(8, 0, 1, cpu), run(8, 0, 0, cpu, "v")]
    rates = {"sessions=1": [100.0], "sessions=8": [300.0], "sessions=8[v]": [280.0]}
    cores = {"": {"proposer": 1, "verifier": 1}}  # the variant's daemons placed by the OS
    out = summarise_sessions(rates, samples, None, cores)
    row = out["sessions=8"]  # 10 ms of the proposer's over 4 session-rounds: 2.5 ms each
    assert row["tokens_per_session_round"] == 2.0
    assert row["busiest_core"] == "proposer"
    assert row["core_bound_tokens_per_s"] == pytest.approx(2.0 / 0.0025)
    assert row["core_bound_ratio_to_1"] == pytest.approx(800.0 / 100.0)
    assert out["sessions=1"]["core_bound_tokens_per_s"] == pytest.approx(2.0 / 0.005)
    assert "core_bound_tokens_per_s" not in out["sessions=8[v]"]
    line = format_sessions(out).splitlines()[2]
    assert line.endswith("(busiest core, proposer: ≤ 800.0 tok/s, 8.00×1)")
    assert "core_bound_tokens_per_s" not in summarise_sessions(rates, samples, None)["sessions=8"]


def test_a_wave_reads_the_lanes_daemons_around_all_its_runs():
    from muser_app.bench.sessions import run_concurrent

    class FakeDaemon:
        def __init__(self, *readings):
            self.readings = iter(readings)

        def cpu_s(self):
            return next(self.readings)

    def lane(prompt, max_tokens):
        return Sample("cluster", 0, 0, [1] * max_tokens, 0.1, 4, 2, 2, {}, {"proposer": 9.0})

    lane.daemons = {"proposer": FakeDaemon(2.0, 2.5), "verifier": FakeDaemon(None, 1.0)}
    samples, wall, cpu = run_concurrent(lane, [[1], [2], [3]], 3)
    assert cpu == {"proposer": 0.5} and wall > 0
    assert [s.prompt for s in samples] == [0, 1, 2] and all(s.cpu_s == {} for s in samples)
