"""Crashes: SIGKILL either daemon at random points, or cut the link, mid-generation.

Every time the final tokens equal the uncrashed run, the client sees no gap and no repeat
(stream_generate refuses an event whose offset is not the count it holds), and
`muser wal verify` passes on both WALs afterwards.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from transformers import AutoTokenizer

from cluster_config import load_config
from muser import keys
from muser.sampling import SamplingParams
from muser_app.cli.cluster_client import stream_generate
from muser_app.cli.status import probe
from muser_app.fixtures import natural_prompts
from muser_app.netproxy import TcpProxy
from tests.cluster.conftest import make_cluster
from tests.cluster.harness import Daemon, muser
from tests.qualify.receipts import qualified_receipt
from verifier_gx import journal
from wal.log import FileLog

PARAMS = SamplingParams(temperature=1.0, max_tokens=160, seed=4242)


def _prompt(pair):
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    return list(tok.encode(natural_prompts(3)[2], add_special_tokens=False))


def uncrashed_run(tmp_path_factory, fixture_pair, params: SamplingParams) -> list[int]:
    """The tokens of an uncrashed run of `params` on the crash tests' prompt (D = 2)."""
    c = make_cluster(tmp_path_factory.mktemp("reference"), fixture_pair, draft_len=2)
    c.start()
    try:
        return stream_generate(c.address, _prompt(fixture_pair), params)["tokens"]
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, fixture_pair):
    """The uncrashed cluster run."""
    return uncrashed_run(tmp_path_factory, fixture_pair, PARAMS)


class Client(threading.Thread):
    def __init__(self, address, prompt, params, limits=None):
        super().__init__(daemon=True)
        self.address, self.prompt, self.params = address, prompt, params
        self.limits = limits
        self.count = 0
        self.result = None
        self.error = None

    def run(self):
        def seen(event):
            self.count += len(event.tokens)

        try:
            self.result = stream_generate(
                self.address, self.prompt, self.params, on_event=seen, limits=self.limits
            )
        except Exception as exc:  # reported by the test thread
            self.error = exc

    def wait_for(self, count: int, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while self.count < count and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        return self.count >= count


def crash_run(
    cluster, prompt, victim: str, points: int, seed: int, proxy=None, address=None, at=None,
    params=PARAMS,
):  # fmt: skip
    """`victim`: a daemon to SIGKILL and restart, or "link" / "silence" for what `proxy`
    does to its connections; the client connects to `address` (the proposer's if None).
    `points` random token counts to strike at, or the counts `at`. Returns the client's
    result and the strikes made."""
    rng = random.Random(seed)
    thresholds = at or sorted(rng.sample(range(2, params.max_tokens - 8), points))
    client = Client(address or cluster.address, prompt, params, cluster.config.limits)
    client.start()
    hits = 0
    for threshold in thresholds:
        if not client.wait_for(threshold):
            break
        time.sleep(rng.uniform(0, 0.01))  # land anywhere inside a round's transaction
        if victim == "link":
            proxy.cut()
        elif victim == "silence":
            assert proxy.silence() >= 1, "no connection through the proxy to silence"
        else:
            daemon = getattr(cluster, victim)
            daemon.kill()
            daemon.start()
        hits += 1
    client.join(300)
    assert client.error is None, f"client failed: {client.error}\n{cluster.proposer.log_tail()}"
    return client.result, hits


def resumes_in(commit_log) -> int:
    """RESUME entries in a verifier's commit log."""
    with FileLog(commit_log) as log:
        return sum(
            isinstance(journal.decode(r.payload), journal.ResumeEntry) for r in log.records(1)
        )


def assert_wal_verifies(log_dir, pubkeys) -> None:
    """`muser wal verify` with these public keys: checksums, head chains and signatures."""
    args = ["wal", "verify", str(log_dir)]
    for key in pubkeys:
        args += ["--pubkey", str(key)]
    out = muser(*args)
    assert out.returncode == 0, f"{log_dir}: {out.stdout}{out.stderr}"
    assert "chain checked by: none" not in out.stdout, out.stdout


def assert_wals_verify(cluster):
    """Both logs verify with both public keys. And the verifier never had to resume a
    session: after every restart it held the round the proposer's open carried (a resume
    point encoded wrongly would show here as RESUME)."""
    pubkeys = [cluster.config.verifier.public_key, cluster.config.proposer.public_key]
    logs = [cluster.config.verifier.wal_dir / "commit", cluster.config.proposer.wal_dir / "journal"]
    assert resumes_in(logs[0]) == 0
    for log_dir in logs:
        assert_wal_verifies(log_dir, pubkeys)


@pytest.mark.parametrize("victim", ["verifier", "proposer"])
def test_sigkill_at_ten_random_points_changes_nothing(tmp_path, fixture_pair, reference, victim):
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2)
    cluster.start()
    try:
        result, hits = crash_run(
            cluster, _prompt(fixture_pair), victim, 10, seed=hash(victim) & 0xFFFF
        )
        assert hits >= 10, f"only {hits} kill points landed before the generation ended"
        assert result["tokens"] == reference
    finally:
        cluster.stop()
    assert_wals_verify(cluster)


def _verifier_behind_proxy(cluster) -> TcpProxy:
    """The proposer reaches the verifier through a started proxy (the verifier's address is
    the proxy's; it binds its own)."""
    host, port = cluster.config.verifier.address.rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    proxy.start()
    text = cluster.config_path.read_text()
    cluster.config_path.write_text(
        text.replace(
            f'address = "{cluster.config.verifier.address}"',
            f'address = "127.0.0.1:{proxy.port}"\nbind = "{cluster.config.verifier.address}"',
        )
    )
    return proxy


def _keepalive(seconds: float):
    """A cluster file edit: keepalive pings after `seconds` quiet, answered within `seconds`."""

    def edit(text: str) -> str:
        return text.replace("keepalive_s = 10.0", f"keepalive_s = {seconds}").replace(
            "keepalive_timeout_s = 10.0", f"keepalive_timeout_s = {seconds}"
        )

    return edit


def _fragment_bytes(cluster) -> int:
    """Fragment bytes the proposer sent to verifiers so far (its status)."""
    return probe(cluster.address, "proposer")["status"]["pool"]["fragment_bytes_sent"]


def test_a_restarted_verifier_is_sent_no_fragment_bytes_again(tmp_path, fixture_pair, reference):
    """The verifier restarts three times mid-generation. Each reopen names the transcript
    and MT state by digest only, and the verifier holds them (its commit log, its fragment
    store), so past the prompt at the first open no fragment byte goes again (each reopen
    used to carry the prompt, the transcript and the MT state: some 3-4 KB here, more the
    longer the text)."""
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2)
    cluster.start()
    prompt = _prompt(fixture_pair)
    client = Client(cluster.address, prompt, PARAMS)
    try:
        client.start()
        assert client.wait_for(20)
        assert _fragment_bytes(cluster) == 4 * len(prompt)  # the prompt, at the first open
        for _ in range(3):
            at = client.count
            cluster.verifier.kill()
            cluster.verifier.start()
            assert client.wait_for(at + 20)
        client.join(300)
        assert client.error is None, f"{client.error}\n{cluster.proposer.log_tail()}"
        assert client.result["tokens"] == reference
        assert _fragment_bytes(cluster) == 4 * len(prompt)
    finally:
        cluster.stop()
    assert_wals_verify(cluster)


def test_cut_connection_mid_stream_changes_nothing(tmp_path, fixture_pair, reference):
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2)
    proxy = _verifier_behind_proxy(cluster)
    cluster.start()
    try:
        result, hits = crash_run(cluster, _prompt(fixture_pair), "link", 10, seed=7, proxy=proxy)
        assert hits >= 10
        assert result["tokens"] == reference
        assert proxy.connections > 1  # the proposer really reconnected
    finally:
        cluster.stop()
        proxy.close()
    assert_wals_verify(cluster)


def test_a_verifier_gone_silent_is_left_and_reached_again(tmp_path, fixture_pair, reference):
    """The link to the verifier goes silent mid-stream, as when its machine loses power:
    nothing is closed, nothing answers. The proposer's keepalive ping goes unanswered, it
    drops the connection and reaches the verifier on a new one; the text is the same. (With
    keepalive off, the round stream waits for ever: this test then times out.) Silenced at
    fixed counts, each well before the end: a silence after the last round has no round
    stream to break."""
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2, edit=_keepalive(0.5))
    assert cluster.config.limits.keepalive_s == 0.5
    proxy = _verifier_behind_proxy(cluster)
    cluster.start()
    try:
        began = time.monotonic()
        result, hits = crash_run(
            cluster, _prompt(fixture_pair), "silence", 3, seed=11, proxy=proxy, at=[20, 60, 100]
        )
        assert hits == 3
        assert result["tokens"] == reference
        assert proxy.connections > 3  # a new connection after each silence
        assert time.monotonic() - began < 60
        assert cluster.proposer.log_tail(100_000).count("round stream broke: UNAVAILABLE") >= 3
    finally:
        cluster.stop()
        proxy.close()
    assert_wals_verify(cluster)


def test_a_proposer_gone_silent_is_left_and_reached_again(tmp_path, fixture_pair, reference):
    """The client's link to the proposer goes silent mid-stream: the client's keepalive
    notices, it reconnects with its session and offset, and the stream goes on without a gap
    or a repeat (stream_generate refuses an event at any other offset). Once: the proposer
    goes on generating meanwhile, and the rest of the stream comes in the reconnect's first
    event."""
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2, edit=_keepalive(0.5))
    cluster.start()
    host, port = cluster.address.rsplit(":", 1)
    try:
        with TcpProxy((host, int(port))) as proxy:
            address = f"127.0.0.1:{proxy.port}"
            began = time.monotonic()
            result, hits = crash_run(
                cluster, _prompt(fixture_pair), "silence", 1, 12, proxy, address, at=[40]
            )
            assert hits == 1
            assert result["tokens"] == reference
            assert proxy.connections >= 2  # the client reconnected
            assert time.monotonic() - began < 60
    finally:
        cluster.stop()
    assert_wals_verify(cluster)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a hundred restarts of a daemon, ~6 s each here: past the default 600
@pytest.mark.parametrize("victim", ["verifier", "proposer"])
def test_sigkill_at_a_hundred_random_points(tmp_path, fixture_pair, reference, victim):
    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2)
    cluster.start()
    try:
        total = 0
        for run in range(10):
            result, hits = crash_run(cluster, _prompt(fixture_pair), victim, 10, seed=run)
            total += hits
            assert result["tokens"] == reference
        assert total >= 100
    finally:
        cluster.stop()
    assert_wals_verify(cluster)


def _other_node(cluster_dir, text: str) -> str:
    """The cluster file of another verifier node at the same address: its own key, an empty
    commit log, its own receipt; both verifier keys enrolled."""
    for old, new in (
        ('key = "keys/verifier.key"', 'key = "keys/other.key"'),
        ('public_key = "keys/verifier.pub"', 'public_key = "keys/other.pub"'),
        ('wal_dir = "wal/verifier"', 'wal_dir = "wal/other"'),
        ('receipt = "qualification.json"', 'receipt = "qualification-other.json"'),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _two_nodes(tmp_path, fixture_pair):
    """A cluster whose verifier address can be served by either of two nodes (own keys,
    own commit logs, both enrolled everywhere); returns it and the other node's daemon."""

    def enrol_other(text: str) -> str:
        keys.write_keypair(
            keys.generate(), tmp_path / "keys/other.key", tmp_path / "keys/other.pub"
        )
        enrolled = 'verifiers = ["keys/verifier.pub"]'
        return text.replace(enrolled, 'verifiers = ["keys/verifier.pub", "keys/other.pub"]')

    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2, edit=enrol_other)
    other_path = tmp_path / "cluster-other.toml"
    other_path.write_text(_other_node(tmp_path, cluster.config_path.read_text()))
    qualified_receipt(load_config(other_path))
    return cluster, Daemon("verifier", other_path, tmp_path / "other")


def _assert_node_logs_verify(tmp_path, resumes: tuple[int, int]) -> None:
    """Each node's commit log holds `resumes` RESUME entries; every log verifies with all
    three public keys."""
    wals = [tmp_path / "wal/verifier/commit", tmp_path / "wal/other/commit"]
    assert [resumes_in(wal) for wal in wals] == list(resumes)
    pubkeys = [tmp_path / k for k in ("keys/verifier.pub", "keys/other.pub", "keys/proposer.pub")]
    for log_dir in [*wals, tmp_path / "wal/proposer/journal"]:
        assert_wal_verifies(log_dir, pubkeys)


@pytest.mark.slow
def test_a_generation_moves_between_two_nodes_at_ten_random_points(
    tmp_path, fixture_pair, reference
):
    """Ten times the node serving the verifier address dies for good and the other one
    takes over, each time resuming from the proposer's last signed round (after the first
    move, always a node left behind). The text is the uncrashed run's."""
    cluster, other = _two_nodes(tmp_path, fixture_pair)
    rng = random.Random(11)
    thresholds = sorted(rng.sample(range(4, PARAMS.max_tokens - 8, 6), 10))
    cluster.start()
    nodes = [cluster.verifier, other]
    client = Client(cluster.address, _prompt(fixture_pair), PARAMS)
    moves = 0
    try:
        client.start()
        for threshold in thresholds:
            if not client.wait_for(threshold):
                break
            nodes[moves % 2].kill()
            nodes[(moves + 1) % 2].start()
            moves += 1
        client.join(300)
        assert client.error is None, f"{client.error}\n{cluster.proposer.log_tail()}"
        assert moves == 10 and client.result["tokens"] == reference
    finally:
        cluster.stop()
        other.stop()
    _assert_node_logs_verify(tmp_path, (5, 5))


def test_a_generation_moves_to_another_verifier_node_and_back(tmp_path, fixture_pair, reference):
    """The verifier dies for good: another node (its own key, an empty commit log) takes its
    address; the proposer's open carries its last signed round and the node resumes from it.
    Then the first node comes back, rounds behind, and resumes in turn. The text is the
    uncrashed run's, and every log verifies."""

    cluster, other = _two_nodes(tmp_path, fixture_pair)
    cluster.start()
    client = Client(cluster.address, _prompt(fixture_pair), PARAMS)
    try:
        client.start()
        assert client.wait_for(40)
        cluster.verifier.kill()
        other.start()
        assert client.wait_for(100)
        other.kill()
        cluster.verifier.start()
        client.join(300)
        assert client.error is None, f"{client.error}\n{cluster.proposer.log_tail()}"
        assert client.result["tokens"] == reference
    finally:
        cluster.stop()
        other.stop()
    # each node resumed once: the other node first, then the first one back
    _assert_node_logs_verify(tmp_path, (1, 1))
    wals = [tmp_path / "wal/verifier/commit", tmp_path / "wal/other/commit"]
    # without the other node's key, the first node's log does not verify: its RESUME carries
    # a round that key signed
    out = muser("wal", "verify", str(wals[0]), "--pubkey", str(tmp_path / "keys/verifier.pub"))
    assert out.returncode != 0 and "resume" in (out.stdout + out.stderr).lower()


def test_sigkill_while_the_verifier_compacts_after_every_session_changes_nothing(
    tmp_path, fixture_pair
):
    """The verifier snapshots its commit log as each session closes (commit_compact_bytes =
    1) and is SIGKILLed and restarted right after sessions end, where the close and the
    compaction run. Every session's tokens equal the same session's uncrashed run, the log
    holds a snapshot, and both logs verify through it."""
    cluster = make_cluster(
        tmp_path,
        fixture_pair,
        draft_len=2,
        edit=lambda t: t.replace("commit_compact_bytes = 268435456", "commit_compact_bytes = 1"),
    )
    assert cluster.config.verifier.commit_compact_bytes == 1
    tok = AutoTokenizer.from_pretrained(str(fixture_pair.target))
    prompts = [tok.encode(p, add_special_tokens=False) for p in natural_prompts(6)]
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=77)
    rng = random.Random(11)
    cluster.start()
    try:
        first = [stream_generate(cluster.address, p, params)["tokens"] for p in prompts]
        killed = 0
        for prompt, tokens in zip(prompts, first, strict=True):
            again = stream_generate(cluster.address, prompt, params, limits=cluster.config.limits)
            assert again["tokens"] == tokens
            time.sleep(rng.uniform(0, 0.03))  # into the close and its compaction
            cluster.verifier.kill()
            cluster.verifier.start()
            killed += 1
    finally:
        cluster.stop()
    assert killed == len(prompts)
    commit = cluster.config.verifier.wal_dir / "commit"
    with FileLog(commit) as log:
        assert log.latest_snapshot() is not None
    assert_wals_verify(cluster)
