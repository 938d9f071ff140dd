"""The proposer's journal is snapshotted and its covered segments dropped; a daemon restarted
on a compacted journal serves exactly what it served before, and `muser wal verify` checks
the chains through the snapshot (proposer_mac/journal.py, "Compaction")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools

import pytest
import pytest_asyncio

import wal
from muser.records import RoundResult, Signed
from muser_app.cli.wal import DAEMON_INTERPRETERS
from proposer_mac import journal
from tests.proposer.restart import proposer_again
from tests.proposer.test_generate_service import PARAMS, start, stop
from tests.verifier.conftest import PROMPT
from wal.base import Snapshot
from wal.interpret import load_interpreters
from wal.tools import verify_log

pytestmark = pytest.mark.asyncio


def pubkeys(key_set) -> list[bytes]:
    """What `muser wal verify --pubkey` reads: the enrolled keys' files."""
    return [(key_set.dir / f"{name}.pub").read_bytes() for name in ("verifier", "proposer")]


async def run_sessions(c, n: int) -> list:
    runners = []
    for _ in range(n):
        runners.append(await c.server.core.start_session(PROMPT, PARAMS))
        await runners[-1].task
    return runners


async def compacted(core, timeout: float = 10.0):
    """The snapshot the background compaction writes once the last session ended."""
    for _ in range(int(timeout / 0.02)):
        snap = core.log.latest_snapshot()
        if snap is not None and snap.seq == core.log.last_seq and not core._compacting.locked():
            return snap
        await asyncio.sleep(0.02)
    raise AssertionError("no snapshot at the journal's last record")


@contextlib.asynccontextmanager
async def restarted(config, c):
    """A proposer daemon started on `config`'s journal (after `c` stopped); its runners."""
    async with proposer_again(config, c) as core:
        yield core.runners


@pytest.fixture
def small_segments(monkeypatch):
    """Journal segments of 4 KiB, so that a few sessions fill several and a snapshot can
    drop some (the default is 8 MiB)."""
    monkeypatch.setattr(wal, "FileLog", functools.partial(wal.FileLog, segment_bytes=4096))


async def test_sessions_ending_past_the_threshold_compact_and_a_restart_serves_the_same(
    key_set, tmp_path, small_segments
):
    c = await start(key_set, tmp_path, proposer={"journal_compact_bytes": 1}, finished_sessions=2)
    try:
        core = c.server.core
        runners = await run_sessions(c, 4)
        snap = await compacted(core)
        assert core.log.first_seq > 1  # the segments the snapshot covers are gone
        assert set(journal.decode_snapshot(snap.data)) == {
            r.session.session_id
            for r in runners[2:]  # limits.finished_sessions = 2
        }
        emitted = {r.session.session_id: list(r.session.emitted) for r in runners}
        config = core.config
    finally:
        await stop(c)
    load_interpreters(DAEMON_INTERPRETERS)  # as `muser wal verify` does
    result = verify_log(config.proposer.wal_dir / "journal", pubkeys(key_set))
    assert result.ok, result.failure
    assert "proposer-journal" in result.chain_checked_by and result.snapshots >= 1

    async with restarted(config, c) as held:
        assert list(held) == [r.session.session_id for r in runners[2:]]
        for sid, runner in held.items():
            assert runner.finished and runner.session.emitted == emitted[sid]
            assert runner.session.next_round == next(
                r.session.next_round for r in runners if r.session.session_id == sid
            )


async def test_a_threshold_of_zero_never_compacts(key_set, tmp_path, small_segments):
    c = await start(key_set, tmp_path, proposer={"journal_compact_bytes": 0})
    try:
        await run_sessions(c, 2)
        await asyncio.sleep(0.2)
        assert c.server.core.log.latest_snapshot() is None and c.server.core.log.first_seq == 1
    finally:
        await stop(c)


async def test_a_large_threshold_waits_for_the_bytes(key_set, tmp_path, small_segments):
    c = await start(key_set, tmp_path, proposer={"journal_compact_bytes": 1 << 30})
    try:
        await run_sessions(c, 2)
        await asyncio.sleep(0.2)
        assert c.server.core.log.latest_snapshot() is None
        await asyncio.to_thread(c.server.core.compact_journal)  # asked for: it compacts
        assert c.server.core.log.latest_snapshot().seq == c.server.core.log.last_seq
        assert await asyncio.to_thread(c.server.core.compact_journal) is None  # nothing new
    finally:
        await stop(c)


@pytest_asyncio.fixture
async def journal_of_a_run(key_set, tmp_path):
    """Every record of a journal that was never compacted: two sessions, run to the end. A
    cut after any record is a journal as a crash would leave it (a session open, a round
    prepared and not committed, one finished)."""
    c = await start(key_set, tmp_path, proposer={"journal_compact_bytes": 0})
    try:
        await run_sessions(c, 2)
        records = list(c.server.core.log.records())
    finally:
        await stop(c)
    tags = [journal.describe(r.payload)["entry"] for r in records]
    assert tags.count("open") == 2 and tags.count("done") == 2 and "prepared" in tags
    return records


def comparable(sessions: dict) -> dict:
    return {sid: dataclasses.asdict(s) for sid, s in sessions.items()}


async def test_replay_from_a_snapshot_at_any_record_equals_the_whole_replay(
    journal_of_a_run, key_set
):
    records = journal_of_a_run
    payloads = [r.payload for r in records]
    whole = journal.replay(payloads)
    checker = journal.WalInterpreter()
    for cut in range(len(payloads) + 1):
        before = journal.replay(payloads[:cut])
        data = journal.snapshot_of(before, keep_finished=10)
        base = journal.decode_snapshot(data)
        assert comparable(base) == comparable(before)  # a prepared round in flight included
        assert comparable(journal.replay(payloads[cut:], base)) == comparable(whole)
        failure = checker.check_chain(records, pubkeys(key_set), Snapshot(cut, data))
        assert failure is None, (cut, failure)
    finished = journal.replay(payloads)
    kept = journal.decode_snapshot(journal.snapshot_of(finished, keep_finished=1))
    assert list(kept) == list(finished)[-1:]  # the latest finished one only


async def test_a_snapshot_whose_chain_was_altered_fails_wal_verify(journal_of_a_run, key_set):
    records = journal_of_a_run
    sessions = journal.replay(r.payload for r in records)
    sid, s = next(iter(sessions.items()))
    checker = journal.WalInterpreter()
    swapped = dataclasses.replace(s, committed=[s.committed[1], s.committed[0], *s.committed[2:]])
    data = journal.snapshot_of({sid: swapped}, keep_finished=1)
    failure = checker.check_chain(records, pubkeys(key_set), Snapshot(len(records), data))
    assert failure and "round 0: result does not chain from the head before it" in failure
    forged = Signed(s.committed[0].body, bytes(64))  # right bytes, wrong signature
    data = journal.snapshot_of(
        {sid: dataclasses.replace(s, committed=[forged, *s.committed[1:]])}, keep_finished=1
    )
    failure = checker.check_chain(records, pubkeys(key_set), Snapshot(len(records), data))
    assert failure and "snapshot at seq" in failure and "round 0" in failure
    assert checker.check_chain(records, [], Snapshot(len(records), data)) is None  # no keys
    assert RoundResult.decode(s.committed[0].body).round == 0
    junk = checker.check_chain(records, [], Snapshot(3, b"not a snapshot"))
    assert junk and junk.startswith("snapshot at seq 3:")


async def test_a_compaction_cut_short_at_any_step_restarts_to_the_same_sessions(
    key_set, tmp_path, small_segments
):
    """A crash during compaction leaves the journal directory as it stood at one of the
    snapshot's steps: its temp file written, renamed into place, each covered segment
    unlinked. Each of those directories, copied at that step, restarts to the sessions the
    finished compaction restarts to (none lost, none repeated) and passes `muser wal verify`."""
    from tests.wal.steps import copies_at_each_step

    c = await start(key_set, tmp_path, proposer={"journal_compact_bytes": 0}, finished_sessions=2)
    try:
        core = c.server.core
        runners = await run_sessions(c, 4)
        emitted = {r.session.session_id: list(r.session.emitted) for r in runners}
        config = core.config
        wal_dir = config.proposer.wal_dir
        with copies_at_each_step(wal_dir, wal_dir / "journal", tmp_path) as states:
            snap = await asyncio.to_thread(core.compact_journal)
        assert snap is not None and core.log.first_seq > 1
    finally:
        await stop(c)
    assert len(states) >= 4  # before and after the rename, and at least two segments dropped
    load_interpreters(DAEMON_INTERPRETERS)
    for state in states:
        result = verify_log(state / "journal", pubkeys(key_set))
        assert result.ok, (state.name, result.failure)
        cfg = config.model_copy(
            update={"proposer": config.proposer.model_copy(update={"wal_dir": state})}
        )
        async with restarted(cfg, c) as held:
            # every session the journal still holds comes back whole; the snapshot keeps
            # the last limits.finished_sessions = 2 finished ones, the segments all four
            assert {r.session.session_id for r in runners[2:]} <= set(held), state.name
            for sid, runner in held.items():
                assert runner.finished and runner.session.emitted == emitted[sid], state.name
