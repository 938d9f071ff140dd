"""The verifier's commit log is snapshotted and its covered segments dropped; a verifier
restarted on a compacted log holds the same sessions and goes on as the uncrashed one would,
and `muser wal verify` checks the chains through the snapshot (verifier_gx/compaction.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import pytest

from muser.errors import JournalError
from muser.keys import key_id
from muser.records import Signed, close_message, state_digest
from muser.wire import muser_v2_pb2 as pb
from muser_app.cli.wal import DAEMON_INTERPRETERS
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config
from tests.verifier.test_recovery import PARAMS, uncrashed
from verifier_gx import compaction, journal, journal_check
from verifier_gx.journal_check import VerifierJournal
from verifier_gx.replay import Replay, SessionState
from wal.base import Snapshot
from wal.interpret import load_interpreters
from wal.log import FileLog
from wal.tools import verify_log

pytestmark = pytest.mark.asyncio


@pytest.fixture
def small_segments(monkeypatch):
    """Commit-log segments of 2 KiB, so that a few sessions fill several and a snapshot can
    drop some (the default is 8 MiB)."""
    import verifier_gx.daemon

    monkeypatch.setattr(
        verifier_gx.daemon, "FileLog", functools.partial(FileLog, segment_bytes=2048)
    )


def config_with(key_set, tmp_path, compact_bytes: int, wal: str = "wal"):
    config = make_config(key_set, tmp_path / wal)
    node = config.verifier.model_copy(update={"commit_compact_bytes": compact_bytes})
    return config.model_copy(update={"verifier": node})


async def close(v: Verifier, client) -> None:
    sid = client.session_id
    await v.stub.CloseSession(
        pb.CloseSessionRequest(
            session_id=sid, epoch=1, signature=client.key.sign(close_message(sid, 1))
        )
    )


async def compacted(v: Verifier, timeout: float = 10.0) -> Snapshot:
    """The snapshot the background compaction writes once the last session closed."""
    log = v.manager.log
    for _ in range(int(timeout / 0.02)):
        snap = log.latest_snapshot()
        if snap is not None and snap.seq == log.last_seq:
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError("no snapshot at the commit log's last record")


def pubkeys(key_set) -> list[bytes]:
    """What `muser wal verify --pubkey` reads: the enrolled keys' files."""
    return [(key_set.dir / f"{name}.pub").read_bytes() for name in ("verifier", "proposer")]


def held(replay: Replay) -> tuple[dict, dict]:
    """Everything a replay holds, comparable."""

    def of(s: SessionState) -> tuple:
        return (s.open.encode(), s.epoch, s.prompt, s.open_signature, s.transcript, s.head,
                state_digest(s.mt), s.next_round, s.produced, s.done, s.committed)  # fmt: skip

    return {sid: of(s) for sid, s in replay.sessions.items()}, dict(replay.closed)


async def test_closing_past_the_threshold_compacts_and_a_restart_goes_on_the_same(
    key_set, tmp_path, small_segments
):
    reference = await uncrashed(key_set, tmp_path)
    config = config_with(key_set, tmp_path, compact_bytes=1)
    v = await Verifier(config, key_set, FakeBackend).start()
    try:
        going, finished, closed = v.client(PARAMS), v.client(PARAMS), v.client(PARAMS)
        await going.open_session()
        await going.run(await going.attach(), rounds=3)  # left open, mid-generation
        for client in (finished, closed):
            await client.open_session()
            await client.run(await client.attach())
        await close(v, closed)
        snap = await compacted(v)
        assert v.manager.log.first_seq > 1  # the segments the snapshot covers are gone
        from verifier_gx.servicer import status_json

        assert status_json(v.manager)["snapshot_seq"] == snap.seq  # `muser status --json`
        before = {c.session_id: v.snapshot(c.session_id) for c in (going, finished)}
        summary = v.manager.replay.closed[closed.session_id]
    finally:
        await v.stop()
    load_interpreters(DAEMON_INTERPRETERS)  # as `muser wal verify` does: both daemons' interpreters
    result = verify_log(config.verifier.wal_dir / "commit", pubkeys(key_set))
    assert result.ok, result.failure
    assert "verifier-journal" in result.chain_checked_by and result.snapshots >= 1

    v2 = await Verifier(config, key_set, FakeBackend).start()
    try:
        assert v2.manager.log.latest_snapshot().seq == snap.seq
        assert {sid: v2.snapshot(sid) for sid in before} == before  # every round kept
        assert v2.manager.replay.closed == {closed.session_id: summary}
        closed.stub = v2.stub
        with pytest.raises(Exception, match="session_closed"):
            await closed.open_session()
        going.stub = v2.stub  # the proposer reconnects, re-opens and goes on
        await going.open_session(fragments={})
        await going.run(await going.attach())
        assert going.out == finished.out == reference
    finally:
        await v2.stop()


async def test_a_threshold_of_zero_never_compacts(key_set, tmp_path, small_segments):
    v = await Verifier(config_with(key_set, tmp_path, 0), key_set, FakeBackend).start()
    try:
        for _ in range(2):
            client = v.client(PARAMS)
            await client.open_session()
            await client.run(await client.attach())
            await close(v, client)
        await asyncio.sleep(0.2)
        assert v.manager.log.latest_snapshot() is None and v.manager.log.first_seq == 1
    finally:
        await v.stop()


async def test_a_large_threshold_waits_for_the_bytes(key_set, tmp_path, small_segments):
    v = await Verifier(config_with(key_set, tmp_path, 1 << 30), key_set, FakeBackend).start()
    try:
        client = v.client(PARAMS)
        await client.open_session()
        await client.run(await client.attach())
        await close(v, client)
        await asyncio.sleep(0.2)
        log, compactor = v.manager.log, v.manager.compactor
        assert log.latest_snapshot() is None
        assert (await asyncio.to_thread(compactor.compact)).seq == log.last_seq  # asked for
        assert await asyncio.to_thread(compactor.compact) is None  # nothing new since
    finally:
        await v.stop()


@pytest.fixture
def records_of_a_run(key_set, tmp_path):
    """Every record of a log never compacted: one session closed, one finished, one left
    mid-generation, and one resumed here after 3 rounds on another node (a RESUME entry,
    then 2 rounds). A cut after any record is a log as a crash would leave it."""

    async def run():
        elsewhere = await Verifier(
            config_with(key_set, tmp_path, 0, wal="elsewhere"), key_set, FakeBackend
        ).start()
        v = await Verifier(config_with(key_set, tmp_path, 0), key_set, FakeBackend).start()
        try:
            moved = elsewhere.client(PARAMS)
            await moved.open_session()
            await moved.run(await moved.attach(), rounds=3)
            clients = [v.client(PARAMS) for _ in range(3)]
            for client, rounds in zip(clients, (None, None, 4), strict=True):
                await client.open_session()
                await client.run(await client.attach(), rounds=rounds)
            await close(v, clients[0])
            moved.stub = v.stub
            assert (await moved.resume_session()).resumed
            await moved.run(await moved.attach(), rounds=2)
            records = [(r.seq, r.payload) for r in v.manager.log.records()]
        finally:
            await v.stop()
            await elsewhere.stop()
        assert [journal_check.describe(p)["entry"] for _, p in records].count("resume") == 1
        return records

    return asyncio.run(run())


def keys_of(key_set) -> tuple[dict, dict]:
    v, p = key_set.verifier.public_key(), key_set.proposer.public_key()
    return {key_id(v): v}, {key_id(p): p}


async def test_replay_from_a_snapshot_at_any_record_equals_the_whole_replay(
    records_of_a_run, key_set
):
    records = records_of_a_run
    vkeys, pkeys = keys_of(key_set)
    whole = Replay()
    for _, payload in records:
        whole.apply(journal.decode(payload))
    checker = VerifierJournal()
    for cut in range(len(records) + 1):
        before = Replay()
        for _, payload in records[:cut]:
            before.apply(journal.decode(payload))
        data = compaction.snapshot_of(before)
        base = compaction.replay_from_snapshot(data, vkeys, pkeys)
        assert held(base) == held(before)
        for _, payload in records[cut:]:
            base.apply(journal.decode(payload))
        assert held(base) == held(whole)
        report = checker.verify(records, verifier_keys=vkeys, snapshot=Snapshot(cut, data))
        assert report.ok and report.records == len(records) - cut, (cut, report.first_bad)
        assert report.sessions == checker.verify(records).sessions


def altered(records, change) -> bytes:
    """The snapshot of the whole run, with one open session's state changed by `change`."""
    replay = Replay()
    for _, payload in records:
        replay.apply(journal.decode(payload))
    sid, state = next((sid, s) for sid, s in replay.sessions.items() if not s.done)
    replay.sessions[sid] = change(state)
    return compaction.snapshot_of(replay)


def swap_rounds(s):
    committed = dict(s.committed)
    committed[1], committed[2] = committed[2], committed[1]
    return dataclasses.replace(s, committed=committed)


def forge_round(s):
    digest, signed = s.committed[1]
    body = Signed.decode(signed).body
    return dataclasses.replace(s, committed={**s.committed, 1: (digest, Signed(body, bytes(64)).encode())})  # fmt: skip


def drop_round(s):
    return dataclasses.replace(s, committed={r: c for r, c in s.committed.items() if r != 1})


def no_rounds(s):
    return dataclasses.replace(s, committed={})


def extra_token(s):
    return dataclasses.replace(s, transcript=[*s.transcript, 5])


def another_mt(s):
    from muser.mt19937 import Mt19937

    return dataclasses.replace(s, mt=Mt19937.from_seed(99))


@pytest.mark.parametrize(
    ("change", "says", "needs_keys"),
    [
        (swap_rounds, "round 1: the signed result is not this session's round", False),
        (forge_round, "round 1", True),
        (drop_round, "rounds [0, 2, 3] kept; expected every round to 4", False),
        (no_rounds, "rounds [] kept; expected every round to 4", False),
        (extra_token, "the MT state or transcript is not its last round's", False),
        (another_mt, "the MT state or transcript is not its last round's", False),
    ],
)
async def test_an_altered_snapshot_fails_wal_verify_and_the_daemon_refuses_it(
    records_of_a_run, key_set, tmp_path, change, says, needs_keys
):
    records = records_of_a_run
    data, last = altered(records, change), records[-1][0]
    vkeys, _ = keys_of(key_set)
    report = VerifierJournal().verify(records, verifier_keys=vkeys, snapshot=Snapshot(last, data))
    assert not report.ok and str(report.first_bad).startswith(f"snapshot at seq {last}: ")
    assert report.first_bad.snapshot and report.first_bad.seq == last
    assert says in report.first_bad.reason
    unkeyed = VerifierJournal().verify(records, snapshot=Snapshot(last, data))
    assert unkeyed.ok == needs_keys  # a forged signature needs the keys to be seen
    failure = journal_check.WalInterpreter().check_chain(
        [dataclasses.make_dataclass("R", ["seq", "payload"])(s, p) for s, p in records],
        pubkeys(key_set),
        Snapshot(last, data),
    )
    assert failure and failure.startswith(f"snapshot at seq {last}: ") and says in failure

    config = config_with(key_set, tmp_path / "refused", 0)
    with FileLog(config.verifier.wal_dir / "commit") as log:
        for _, payload in records:
            log.append(payload)
        log.write_snapshot(data, last)
    with pytest.raises(JournalError, match="snapshot at seq .* does not replay"):
        await Verifier(config, key_set, FakeBackend).start()


async def test_the_other_daemons_snapshot_is_left_to_its_interpreter(records_of_a_run):
    """A proposer journal's snapshot is not the verifier's to read; junk is refused."""
    from proposer_mac import journal as proposer_journal

    records = [dataclasses.make_dataclass("R", ["seq", "payload"])(s, p) for s, p in records_of_a_run]  # fmt: skip
    theirs = proposer_journal.snapshot_of({}, keep_finished=1)
    assert journal_check.WalInterpreter().check_chain(records, [], Snapshot(1, theirs)) is None
    ours = compaction.snapshot_of(Replay())
    assert proposer_journal.WalInterpreter().check_chain([], [], Snapshot(1, ours)) is None
    junk = journal_check.WalInterpreter().check_chain(records, [], Snapshot(3, b"not a snapshot"))
    assert junk and junk.startswith("snapshot at seq 3:")


async def test_a_compaction_cut_short_at_any_step_restarts_to_the_same_sessions(
    key_set, tmp_path, small_segments
):
    """A crash during compaction leaves the log directory as it stood at one of the
    snapshot's steps: its temp file written, renamed into place, each covered segment
    unlinked. Each of those directories, copied at that step, restarts to the sessions the
    finished compaction restarts to and passes `muser wal verify`."""
    from tests.wal.steps import copies_at_each_step

    config = config_with(key_set, tmp_path, 0)
    wal_dir = config.verifier.wal_dir
    v = await Verifier(config, key_set, FakeBackend).start()
    try:
        clients = [v.client(PARAMS) for _ in range(3)]
        for client, rounds in zip(clients, (None, None, 4), strict=True):
            await client.open_session()
            await client.run(await client.attach(), rounds=rounds)
        await close(v, clients[0])
        before = held(v.manager.replay)
        with copies_at_each_step(wal_dir, wal_dir / "commit", tmp_path) as states:
            snap = await asyncio.to_thread(v.manager.compactor.compact)
        assert snap is not None and v.manager.log.first_seq > 1
    finally:
        await v.stop()
    assert len(states) >= 4  # before and after the rename, and at least two segments dropped
    load_interpreters(DAEMON_INTERPRETERS)
    for state in states:
        result = verify_log(state / "commit", pubkeys(key_set))
        assert result.ok, (state.name, result.failure)
        node = config.verifier.model_copy(update={"wal_dir": state})
        again = await Verifier(
            config.model_copy(update={"verifier": node}), key_set, FakeBackend
        ).start()
        try:
            assert held(again.manager.replay) == before, state.name
        finally:
            await again.stop()
