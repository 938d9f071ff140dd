"""The stats objects and their Prometheus export, over known observations: every value in
the exposition is checked exactly (it must also parse with prometheus_client's parser)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from muser.metrics import DaemonView, exposition, status_fields, tokens_per_s, wal_bytes
from muser.stats import (
    RATE_WINDOW_S,
    DaemonStats,
    DraftingStats,
    Histogram,
    LaneStats,
    VerifierStats,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for every sample of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_histogram_buckets_are_inclusive_and_cumulative():
    h = Histogram(bounds=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (math.inf, 5)]
    assert (h.count, h.sum) == (5, pytest.approx(4.65))
    assert h.quantile(0.5) == 0.5 and h.quantile(0.99) == 3.0 and h.quantile(0.0) == 0.05
    assert Histogram().quantile(0.5) is None and Histogram().mean is None


def test_histogram_refuses_unsorted_bounds():
    with pytest.raises(ValueError, match="increase strictly"):
        Histogram(bounds=(1.0, 0.5))


def test_round_split_is_what_the_sums_gained_since_the_last_close():
    """The driver adds a round's times to the sums, then closes the round; the local lane
    does the same; the verifier passes them to observe_round. Both give the same split."""
    lane = LaneStats()
    lane.draft_s += 0.25  # added before the close (the driver's draft)
    lane.observe_round(4, 2, 3, verify_s=0.5, wal_s=0.125)
    lane.draft_s += 0.5
    lane.transport_s += 0.0625
    lane.observe_round(4, 4, 5)

    def split(phase: str) -> tuple[int, float, float, int]:
        """count, sum, max, and how many rounds spent no time in it"""
        h = lane.phases[phase]
        return h.count, h.sum, h.max, h.cumulative()[0][1]

    assert split("draft") == (2, 0.75, 0.5, 0)
    assert split("verify") == (2, 0.5, 0.5, 1)
    assert split("wal") == (2, 0.125, 0.125, 1)
    assert split("transport") == (2, 0.0625, 0.0625, 1)
    assert split("sign") == (2, 0.0, 0.0, 2)
    assert (lane.rounds, lane.drafted, lane.accepted, lane.emitted) == (2, 8, 6, 8)
    assert lane.tokens_per_round_hist == {3: 1, 5: 1}
    assert lane.acceptance == 0.75 and lane.verifier_ceiling == 16.0


def test_tokens_per_second_counts_the_trailing_window():
    clock = Clock()
    stats = VerifierStats(clock=clock)
    stats.observe_round(2, 1, 2)
    clock.now += 30
    stats.observe_round(2, 2, 3)
    view = DaemonView("verifier", "k", stats, stats, 1, 1, None, now=clock.now)
    assert tokens_per_s(view) == pytest.approx(5 / 30)  # uptime 30 s < the window
    clock.now += RATE_WINDOW_S - 10  # the first round (t=0) falls out of the window
    stats.observe_round(1, 0, 1)
    view = DaemonView("verifier", "k", stats, stats, 1, 1, None, now=clock.now)
    assert tokens_per_s(view) == pytest.approx(4 / RATE_WINDOW_S)


def test_lane_total_sums_sessions():
    a, b = LaneStats(), LaneStats()
    a.observe_round(4, 3, 4, verify_s=0.5)
    b.observe_round(4, 1, 2, verify_s=0.25)
    b.observe_round(0, 0, 1, verify_s=0.25)
    total = LaneStats.total([a, b])
    assert (total.rounds, total.drafted, total.accepted, total.emitted) == (3, 8, 4, 7)
    assert total.tokens_per_round_hist == {4: 1, 2: 1, 1: 1}
    assert total.draft_len_hist == {4: 2, 0: 1}
    assert total.verify_s == 1.0 and total.phases["verify"].count == 3
    assert total.phases["verify"].sum == 1.0


@pytest.fixture
def known(tmp_path) -> DaemonView:
    """A verifier that committed two rounds, answered a retry, refused three requests and
    fsynced its WAL twice; its WAL directory holds 100 + 28 bytes."""
    clock = Clock()
    stats = VerifierStats(clock=clock)
    stats.observe_round(4, 4, 5, verify_s=0.5, wal_s=0.002, sign_s=0.0001)
    stats.observe_round(4, 1, 2, verify_s=0.25, wal_s=0.003, sign_s=0.0001)
    stats.retries += 1
    stats.observe_refusal("head_mismatch", "ABORTED")
    stats.observe_refusal("head_mismatch", "ABORTED")
    stats.observe_refusal("draft_zero_probability", "INVALID_ARGUMENT")
    stats.observe_fsync(0.0004)
    stats.observe_fsync(0.02)
    (tmp_path / "seg-1.wal").write_bytes(b"x" * 100)
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "old").write_bytes(b"y" * 28)
    clock.now += 10
    return DaemonView("verifier", "abc123", stats, stats, 3, 2, tmp_path, clock.now, retries=1)


def test_exposition_holds_the_observed_values(known):
    got = samples(exposition(lambda: known))
    expected = {
        ("muser_info", (("key_id", "abc123"), ("role", "verifier"))): 1.0,
        ("muser_sessions", ()): 3.0,
        ("muser_open_sessions", ()): 2.0,
        ("muser_rounds_total", ()): 2.0,
        ("muser_drafted_tokens_total", ()): 8.0,
        ("muser_accepted_tokens_total", ()): 5.0,
        ("muser_emitted_tokens_total", ()): 7.0,
        ("muser_acceptance_ratio", ()): 5 / 8,
        ("muser_verifier_ceiling_tokens_per_second", ()): 7 / 0.75,
        ("muser_wal_bytes", ()): 128.0,
        ("muser_retries_total", ()): 1.0,
        ("muser_refusals_total", (("code", "ABORTED"), ("reason", "head_mismatch"))): 2.0,
        (
            "muser_refusals_total",
            (("code", "INVALID_ARGUMENT"), ("reason", "draft_zero_probability")),
        ): 1.0,
        # tokens per round: one round of 2, one of 5
        ("muser_tokens_per_round_bucket", (("le", "1.0"),)): 0.0,
        ("muser_tokens_per_round_bucket", (("le", "2.0"),)): 1.0,
        ("muser_tokens_per_round_bucket", (("le", "4.0"),)): 1.0,
        ("muser_tokens_per_round_bucket", (("le", "5.0"),)): 2.0,
        ("muser_tokens_per_round_bucket", (("le", "65.0"),)): 2.0,
        ("muser_tokens_per_round_bucket", (("le", "+Inf"),)): 2.0,
        ("muser_tokens_per_round_count", ()): 2.0,
        ("muser_tokens_per_round_sum", ()): 7.0,
        # both rounds drafted four tokens
        ("muser_rounds_by_draft_len_total", (("draft_len", "4"),)): 2.0,
        # fsync: 0.4 ms and 20 ms
        ("muser_wal_fsync_seconds_bucket", (("le", "0.00025"),)): 0.0,
        ("muser_wal_fsync_seconds_bucket", (("le", "0.0005"),)): 1.0,
        ("muser_wal_fsync_seconds_bucket", (("le", "0.01"),)): 1.0,
        ("muser_wal_fsync_seconds_bucket", (("le", "0.025"),)): 2.0,
        ("muser_wal_fsync_seconds_bucket", (("le", "+Inf"),)): 2.0,
        ("muser_wal_fsync_seconds_count", ()): 2.0,
        ("muser_wal_fsync_seconds_sum", ()): 0.0204,
        # the split: verify 0.5 s and 0.25 s
        ("muser_round_phase_seconds_bucket", (("le", "0.1"), ("phase", "verify"))): 0.0,
        ("muser_round_phase_seconds_bucket", (("le", "0.25"), ("phase", "verify"))): 1.0,
        ("muser_round_phase_seconds_bucket", (("le", "0.5"), ("phase", "verify"))): 2.0,
        ("muser_round_phase_seconds_count", (("phase", "verify"),)): 2.0,
        ("muser_round_phase_seconds_sum", (("phase", "verify"),)): 0.75,
        ("muser_round_phase_seconds_bucket", (("le", "0.0025"), ("phase", "wal"))): 1.0,
        ("muser_round_phase_seconds_bucket", (("le", "0.005"), ("phase", "wal"))): 2.0,
        ("muser_round_phase_seconds_sum", (("phase", "wal"),)): 0.005,
        ("muser_round_phase_seconds_count", (("phase", "sign"),)): 2.0,
    }
    for key, value in expected.items():
        assert key in got, f"{key} missing from the exposition"
        assert got[key] == pytest.approx(value, rel=1e-12), key
    phases = {dict(labels)["phase"] for name, labels in got if name.startswith("muser_round_")}
    assert phases == {"verify", "wal", "sign"}  # the verifier neither drafts nor transports


def test_the_verifier_exposition_counts_resumed_sessions(known):
    stats = known.lane
    stats.resumes, stats.idle_closed = 2, 3
    view = dataclasses.replace(known, verifier=stats, round_queue=0, kv_sessions=1)
    got = samples(exposition(lambda: view))
    assert got[("muser_resumes_total", ())] == 2.0
    assert got[("muser_idle_closed_total", ())] == 3.0


def test_proposer_exposition_has_every_phase_and_no_retries(tmp_path):
    lane = LaneStats()
    lane.observe_round(4, 2, 3, draft_s=0.01, transport_s=0.002, verify_s=0.1)
    view = DaemonView("proposer", "p", lane, DaemonStats(), 1, 0, tmp_path, lane.clock())
    got = samples(exposition(lambda: view))
    phases = {dict(labels).get("phase") for name, labels in got if "phase" in dict(labels)}
    assert phases == {"draft", "transport", "verify", "wal", "sign"}
    assert not any(name == "muser_retries_total" for name, _ in got)
    assert got[("muser_wal_bytes", ())] == 0.0
    assert got[("muser_wal_fsync_seconds_count", ())] == 0.0


def test_proposer_exports_its_draft_batch_sizes(tmp_path):
    lane, drafting = LaneStats(), DraftingStats()
    for size in (1, 1, 3, 8):
        drafting.observe_batch(size)
    view = DaemonView(
        "proposer", "p", lane, DaemonStats(), 1, 0, tmp_path, lane.clock(), drafting=drafting
    )
    got = samples(exposition(lambda: view))
    bucket = lambda le: got[("muser_draft_batch_size_bucket", (("le", le),))]  # noqa: E731
    assert (bucket("1.0"), bucket("2.0"), bucket("4.0"), bucket("8.0"), bucket("+Inf")) == (
        2.0, 2.0, 3.0, 4.0, 4.0,
    )  # fmt: skip
    assert got[("muser_draft_batch_size_sum", ())] == 13.0
    assert got[("muser_draft_batch_size_count", ())] == 4.0
    verifier = DaemonView("verifier", "v", lane, DaemonStats(), 1, 0, tmp_path, lane.clock())
    assert not any(
        n.startswith("muser_draft_batch") for n, _ in samples(exposition(lambda: verifier))
    )


def test_status_fields(known):
    fields = status_fields(known)
    assert fields["sessions"] == 3 and fields["open_sessions"] == 2
    assert fields["acceptance"] == 5 / 8 and fields["emitted"] == 7
    assert fields["tokens_per_s"] == pytest.approx(7 / 10)  # 10 s up, both rounds inside
    assert fields["refusals"] == {"head_mismatch": 2, "draft_zero_probability": 1}
    wal = fields["wal"]
    assert wal["bytes"] == 128 and wal["fsyncs"] == 2
    assert (wal["fsync_p50_s"], wal["fsync_p99_s"], wal["fsync_max_s"]) == (0.0004, 0.02, 0.02)


def test_wal_bytes_of_a_missing_directory_is_zero(tmp_path):
    assert wal_bytes(tmp_path / "nothing") == 0 and wal_bytes(None) is None


def test_proposer_exports_its_pool_counters(tmp_path):
    lane = LaneStats()
    lane.moves = 3
    view = DaemonView(
        "proposer", "p", lane, DaemonStats(), 1, 0, tmp_path, lane.clock(),
        placement={"a": 1, "b": 0}, fences=2, fragment_bytes=4096,
    )  # fmt: skip
    got = samples(exposition(lambda: view))
    assert got[("muser_session_moves_total", ())] == 3.0
    assert got[("muser_verifier_fences_total", ())] == 2.0
    assert got[("muser_fragment_bytes_sent_total", ())] == 4096.0
    assert got[("muser_sessions_by_verifier", (("verifier", "a"),))] == 1.0
    assert got[("muser_sessions_by_verifier", (("verifier", "b"),))] == 0.0


def test_proposer_exports_its_capture_counters(tmp_path):
    """A conditioned draft's features: the bytes results named, the time installing them;
    and the nodes its tree rounds drafted."""
    lane = LaneStats()
    lane.capture_bytes, lane.feature_install_s, lane.tree_nodes = 6912, 0.25, 48
    view = DaemonView("proposer", "p", lane, DaemonStats(), 1, 0, tmp_path, lane.clock())
    got = samples(exposition(lambda: view))
    assert got[("muser_tree_nodes_total", ())] == 48.0
    assert got[("muser_capture_bytes_total", ())] == 6912.0
    assert got[("muser_feature_install_seconds_total", ())] == 0.25
    other = LaneStats()
    other.capture_bytes, other.tree_nodes = 100, 16
    lane.merge(other)  # the proposer sums its sessions
    assert lane.capture_bytes == 7012 and lane.to_dict()["capture"]["bytes"] == 7012
    assert lane.to_dict()["tree"]["nodes"] == 64
