"""A verifier pool with fenced failover, on real daemons: three verifiers (each its own key,
commit log and receipt, every key enrolled everywhere) and one proposer whose cluster file
lists the other two as [[pool]].

Every run ends with the text of the uncrashed run (stream_generate refuses an event whose
offset is not the count it holds: no token twice, none lost), every log verifying with all
four public keys, and each round the proposer committed signed by the verifier the session
lived on at that round's epoch (`assert_one_signer_per_round`): no result signed by another
verifier for a (session, round) was taken.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cluster_config import load_config
from muser import keys
from muser.canonical import Reader
from muser.records import RoundResult, Signed
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from muser_app.cli.config import free_ports
from muser_app.netproxy import TcpProxy
from proposer_mac import journal as pjournal
from tests.cluster.conftest import Cluster, make_cluster
from tests.cluster.harness import Daemon
from tests.cluster.test_crash import (
    Client,
    _keepalive,
    _prompt,
    assert_wal_verifies,
    resumes_in,
    uncrashed_run,
)
from tests.qualify.receipts import qualified_receipt
from wal.log import FileLog

PARAMS = SamplingParams(temperature=1.0, max_tokens=320, seed=2027)
FAILOVER_S = 0.5
NODES = ("verifier", "b", "c")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, fixture_pair):
    """The uncrashed run, on a lone verifier."""
    return uncrashed_run(tmp_path_factory, fixture_pair, PARAMS)


@dataclass
class Pool:
    cluster: Cluster
    nodes: dict[str, Daemon]
    """Each verifier's daemon by its pool name ("verifier" is the cluster's own)."""
    dir: Path

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()
        self.cluster.proposer.start()

    def stop(self) -> None:
        self.cluster.proposer.stop()
        for node in self.nodes.values():
            node.stop()

    def status(self) -> dict:
        address = self.cluster.config.proposer.address
        with grpc.insecure_channel(address) as channel:
            reply = pb_grpc.ProposerStub(channel).Status(pb.StatusRequest(), timeout=10)
        return json.loads(reply.json)

    def home(self) -> str | None:
        """The verifier the one running session lives on (None: none running)."""
        sessions = self.status()["pool"]["sessions"]
        return sessions[0]["verifier"] if sessions else None

    def wals(self) -> list[Path]:
        return [self.dir / f"wal/{name}/commit" for name in NODES]

    def pubkeys(self) -> list[Path]:
        return [self.dir / f"keys/{name}.pub" for name in (*NODES, "proposer")]


def _node_file(text: str, name: str, port: int) -> str:
    """The cluster file of pool verifier `name`: its own key, commit log, receipt and
    address; no HTTP server (one per machine port)."""
    head, sep, tail = text.partition("[proposer]")
    head = re.sub(r'(?m)^address = ".*"$', f'address = "127.0.0.1:{port}"', head, count=1)
    head = re.sub(r"(?m)^http = .*\n", "", head, count=1)
    for old, new in (
        ('key = "keys/verifier.key"', f'key = "keys/{name}.key"'),
        ('public_key = "keys/verifier.pub"', f'public_key = "keys/{name}.pub"'),
        ('wal_dir = "wal/verifier"', f'wal_dir = "wal/{name}"'),
    ):
        assert head.count(old) == 1, old
        head = head.replace(old, new)
    head = head.replace("[verifier]\n", f'[verifier]\nname = "{name}"\n', 1)
    tail = tail.replace('receipt = "qualification.json"', f'receipt = "qualification-{name}.json"')
    return head + sep + tail


def make_pool(tmp_path: Path, fixture_pair, edit=None) -> Pool:
    """Three verifiers and a proposer whose [[pool]] lists the two besides [verifier]."""
    others = NODES[1:]

    def enrol_all(text: str) -> str:
        for name in others:
            keys.write_keypair(
                keys.generate(), tmp_path / f"keys/{name}.key", tmp_path / f"keys/{name}.pub"
            )
        enrolled = ", ".join(f'"keys/{n}.pub"' for n in NODES)
        text = text.replace('verifiers = ["keys/verifier.pub"]', f"verifiers = [{enrolled}]")
        text = text.replace("[proposer]\n", f"[proposer]\nfailover_s = {FAILOVER_S}\n", 1)
        return edit(text) if edit is not None else text

    cluster = make_cluster(tmp_path, fixture_pair, draft_len=2, edit=enrol_all)
    text = cluster.config_path.read_text()
    ports = free_ports(len(others))
    nodes = {"verifier": cluster.verifier}
    pool_tables = ""
    for name, port in zip(others, ports, strict=True):
        path = tmp_path / f"cluster-{name}.toml"
        path.write_text(_node_file(text, name, port))
        qualified_receipt(load_config(path))
        nodes[name] = Daemon("verifier", path, tmp_path / name)
        pool_tables += (
            f'\n[[pool]]\nname = "{name}"\naddress = "127.0.0.1:{port}"\n'
            f'public_key = "keys/{name}.pub"\nreceipt = "qualification-{name}.json"\n'
        )
    cluster.config_path.write_text(text + pool_tables)
    cluster.config = load_config(cluster.config_path)
    assert [v.name for v in cluster.config.pool] == list(others)
    assert cluster.config.proposer.failover_s == FAILOVER_S
    return Pool(cluster, nodes, tmp_path)


def assert_one_signer_per_round(pool: Pool) -> dict:
    """Replay the proposer's journal: every COMMITTED result carries the epoch the session
    was at and is signed by the verifier it lived on then (MOVED says which). Returns
    {"moves": MOVED entries past the first placement, "rounds": rounds committed}."""
    key_of = {name: keys.key_id(keys.load_public(pool.dir / f"keys/{name}.pub")) for name in NODES}
    home: dict[bytes, tuple[str, int]] = {}
    moves = rounds = 0
    with FileLog(pool.dir / "wal/proposer/journal") as log:
        for record in log.records(1):
            entry = pjournal.describe(record.payload)
            sid = bytes.fromhex(entry["session"])
            if entry["entry"] == "moved":
                moves += sid in home
                assert entry["epoch"] >= home.get(sid, ("", 0))[1]
                home[sid] = (entry["verifier"], entry["epoch"])
            elif entry["entry"] == "committed":
                result = _committed_result(record.payload)
                name, epoch = home[sid]
                assert (result.verifier_key_id, result.epoch) == (key_of[name], epoch), (
                    f"round {result.round} signed by {result.verifier_key_id} at epoch "
                    f"{result.epoch}; the session lived on {name} ({key_of[name]}) at {epoch}"
                )
                rounds += 1
    return {"moves": moves, "rounds": rounds}


def _committed_result(payload: bytes) -> RoundResult:
    r = Reader(payload, pjournal.DOMAIN)
    assert r.u32() == pjournal.COMMITTED
    r.raw(16), r.u64()
    return RoundResult.decode(Signed.decode(r.blob()).body)


def _restart_in_background(node: Daemon) -> threading.Thread:
    thread = threading.Thread(target=node.start, daemon=True)
    thread.start()
    return thread


def _generation_with_kills(
    pool: Pool, prompt: list[int], kills: int, rng: random.Random
) -> tuple[int, dict]:
    """One generation of the uncrashed run's request, killing the verifier the session lives
    on at random token counts, up to `kills` times, each with the two others up: a killed
    verifier restarts at once (in the background; the session moves meanwhile), and the
    next kill waits for it. Returns the kills made and the client's result."""
    client = Client(pool.cluster.address, prompt, PARAMS, pool.cluster.config.limits)
    client.start()
    made, count = 0, 0
    while made < kills:
        count = rng.randrange(count + 4, count + 60)
        if count >= PARAMS.max_tokens - 8 or not client.wait_for(count):
            break
        home = pool.home()
        if home is None:
            break
        time.sleep(rng.uniform(0, 0.02))  # anywhere inside a round's transaction
        node = pool.nodes[home]
        node.kill()
        made += 1
        restart = threading.Thread(target=node.start, daemon=True)
        restart.start()
        deadline = time.monotonic() + 60  # the session leaves it
        while pool.home() == home and client.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        restart.join(120)  # two others up before the next kill
        assert node.alive(), node.log_tail()
        count = client.count
    client.join(600)
    assert client.error is None, (
        f"client failed: {client.error}\n{pool.cluster.proposer.log_tail()}"
    )
    return made, client.result


def _kill_the_home(pool: Pool, prompt: list[int], kills: int, seed: int, reference) -> int:
    """Generations of the same request until `kills` kills were made; each ends with the
    uncrashed run's text. Returns the generations run."""
    rng, made, runs = random.Random(seed), 0, 0
    while made < kills:
        got, result = _generation_with_kills(pool, prompt, kills - made, rng)
        assert result["tokens"] == reference, f"generation {runs} ({got} kills)"
        made, runs = made + got, runs + 1
    return runs


@pytest.fixture
def pool(tmp_path, fixture_pair):
    p = make_pool(tmp_path, fixture_pair)
    p.start()
    yield p
    p.stop()


def _assert_logs_verify(pool: Pool) -> None:
    for log_dir in [*pool.wals(), pool.dir / "wal/proposer/journal"]:
        assert_wal_verifies(log_dir, pool.pubkeys())


def test_killing_the_active_verifier_ten_times_moves_the_session_and_changes_nothing(
    pool, fixture_pair, reference
):
    _kill_the_home(pool, _prompt(fixture_pair), 10, 5, reference)
    status = pool.status()["pool"]
    assert status["moves"] >= 10 and status["placement"] == dict.fromkeys(NODES, 0)
    pool.stop()
    seen = assert_one_signer_per_round(pool)
    assert seen["moves"] >= 10 and seen["rounds"] > 0
    assert sum(resumes_in(wal) for wal in pool.wals()) >= 10  # each move resumed somewhere
    _assert_logs_verify(pool)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_killing_the_active_verifier_a_hundred_times(tmp_path, fixture_pair, reference):
    """A hundred kills, over as many generations of the uncrashed run's request as it takes;
    every one ends with the uncrashed run's text. The proposer keeps its whole journal (no
    snapshot: some 350 MB of it here), so every round's signer can be checked."""

    def whole_journal(text: str) -> str:
        return text.replace("journal_compact_bytes = 268435456", "journal_compact_bytes = 0")

    p = make_pool(tmp_path, fixture_pair, edit=whole_journal)
    assert p.cluster.config.proposer.journal_compact_bytes == 0
    p.start()
    try:
        _kill_the_home(p, _prompt(fixture_pair), 100, 100, reference)
    finally:
        p.stop()
    seen = assert_one_signer_per_round(p)
    assert seen["moves"] >= 100
    _assert_logs_verify(p)


def _epochs_held(commit_log: Path) -> tuple[dict[bytes, int], set[bytes]]:
    """The epoch a verifier's commit log holds each session at (OPEN, EPOCH, RESUME), and
    the sessions it closed."""
    from verifier_gx import journal as vjournal

    held: dict[bytes, int] = {}
    closed: set[bytes] = set()
    with FileLog(commit_log) as log:
        for record in log.records(1):
            entry = vjournal.decode(record.payload)
            if isinstance(entry, vjournal.CloseEntry):
                closed.add(entry.session_id)
            elif isinstance(entry, vjournal.EpochEntry):
                held[entry.session_id] = entry.epoch
            elif isinstance(entry, vjournal.OpenEntry | vjournal.ResumeEntry):
                held[entry.open.session_id] = entry.epoch
    return held, closed


def _attach_refused(address: str, session_id: bytes, epoch: int) -> tuple[grpc.StatusCode, str]:
    """What the verifier at `address` answers a Rounds stream attaching at `epoch`."""
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.VerifierStub(channel).Rounds(
            iter([pb.ProposerMessage(attach=pb.Attach(session_id=session_id, epoch=epoch))]),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    return err.value.code(), err.value.details()


def test_a_partitioned_verifier_is_left_and_refuses_the_old_epoch_once_reachable(
    tmp_path, fixture_pair, reference
):
    """The network parts between the proposer and the verifier the session lives on (a
    proxy: live connections go silent, new ones are never answered). The keepalive drops
    the stream, the open there goes unanswered past failover_s, and the session moves to
    the next verifier at epoch 2. When the network heals, the verifier left is told the
    new epoch: its log holds the session at epoch 2, and it refuses epoch 1."""
    pool = make_pool(tmp_path, fixture_pair, edit=_keepalive(0.5))
    host, port = pool.cluster.config.verifier.address.rsplit(":", 1)
    proxy = TcpProxy((host, int(port)))
    proxy.start()
    text = pool.cluster.config_path.read_text()
    old = f'address = "{pool.cluster.config.verifier.address}"'
    assert text.count(old) == 1
    pool.cluster.config_path.write_text(
        text.replace(old, f'address = "127.0.0.1:{proxy.port}"\nbind = "{host}:{port}"')
    )
    pool.start()
    client = Client(pool.cluster.address, _prompt(fixture_pair), PARAMS)
    try:
        client.start()
        assert client.wait_for(40)
        assert pool.home() == "verifier"
        assert proxy.partition() >= 1
        deadline = time.monotonic() + 30
        while pool.home() == "verifier" and client.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        session = pool.status()["pool"]["sessions"]
        assert session and session[0]["verifier"] == "b" and session[0]["epoch"] == 2
        sid = bytes.fromhex(session[0]["session"])
        assert session[0]["moves"] == 1
        proxy.heal()
        client.join(300)
        assert client.error is None, f"{client.error}\n{pool.cluster.proposer.log_tail()}"
        assert client.result["tokens"] == reference
        deadline = time.monotonic() + 30
        while pool.status()["pool"]["fences"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.status()["pool"]["fences"] == 1
        # the verifier left (reached at its own address, past the proxy) refuses epoch 1
        code, details = _attach_refused(f"{host}:{port}", sid, 1)
        assert code in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION), details
        assert "stale" in details or "closed" in details, details
    finally:
        pool.stop()
        proxy.close()
    # the network healed after the session ended (a connect across a partition waits ~20 s
    # here): the verifier left closed it (a close at epoch 2), so it takes nothing more
    held, closed = _epochs_held(tmp_path / "wal/verifier/commit")
    assert held[sid] == 2 or sid in closed
    assert _epochs_held(tmp_path / "wal/b/commit")[0][sid] == 2
    seen = assert_one_signer_per_round(pool)
    assert seen["moves"] == 1
    _assert_logs_verify(pool)
