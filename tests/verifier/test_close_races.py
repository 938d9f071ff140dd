"""Closes that wait on a session's lock behind something else (a round, another close, a
resume, a reopen), and an idle sweep cancelled mid-close: the commit log gets one CLOSE,
applied, or none, and a verifier restarted on it starts (verifier_gx.sessions). Each of these
was a bug: a second CLOSE that made the log refuse to replay, a close from a fenced-off
epoch accepted, a reopen answered with KeyError, a CLOSE durable but not applied."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from muser.errors import StaleEpochError
from muser.records import close_message
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config
from tests.verifier.test_idle import started
from tests.verifier.test_open import refused

pytestmark = pytest.mark.asyncio

PARAMS = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
C = grpc.StatusCode


def close_call(v: Verifier, client, epoch: int = 1):
    sid = client.session_id
    return v.stub.CloseSession(
        pb.CloseSessionRequest(
            session_id=sid, epoch=epoch, signature=client.key.sign(close_message(sid, epoch))
        )
    )


async def restarts_closed(v: Verifier, sid: bytes) -> None:
    """The commit log replays (a restart would refuse a second CLOSE or a ROUND after one)
    and holds the session closed."""
    await v.stop()
    await v.start()
    assert sid in v.manager.replay.closed and sid not in v.manager.replay.sessions


async def test_two_closes_at_once_write_one_close(key_set, tmp_path):
    v = await Verifier(make_config(key_set, tmp_path / "wal"), key_set, FakeBackend).start()
    try:
        c = v.client(PARAMS)
        await c.open_session()
        await c.run(await c.attach(), rounds=1)
        seq = v.wal_seq
        await asyncio.gather(close_call(v, c), close_call(v, c))  # both answered OK
        assert v.wal_seq == seq + 1
        await restarts_closed(v, c.session_id)
    finally:
        await v.stop()


async def test_a_close_queued_behind_a_resume_is_fenced_off(key_set, tmp_path):
    """The old proposer's close (epoch 1) waits behind a round; meanwhile a new proposer
    resumes the session at epoch 2, which replaces its state. The close is refused as
    stale, and the session stays open for the new proposer."""
    a = await Verifier(make_config(key_set, tmp_path / "a"), key_set, FakeBackend).start()
    b = await Verifier(make_config(key_set, tmp_path / "b"), key_set, FakeBackend).start()
    try:
        c = a.client(PARAMS)
        await c.open_session()
        await c.run(await c.attach(), rounds=3)
        c.stub = b.stub
        await c.open_session()  # b holds the session from its start, at epoch 1
        sid, m = c.session_id, b.manager
        old = key_set.proposer.sign(close_message(sid, 1))
        lock = m.lock(sid)
        await lock.acquire()  # a round in progress
        c.epoch = 2
        resume = asyncio.ensure_future(c.resume_session())
        await asyncio.sleep(0.1)
        close = asyncio.ensure_future(m.close_session(sid, 1, old))
        await asyncio.sleep(0.05)
        seq = b.wal_seq
        lock.release()
        assert (await resume).resumed
        with pytest.raises(StaleEpochError):
            await close
        assert b.wal_seq == seq + 1  # the RESUME, no CLOSE
        assert m.replay.sessions[sid].epoch == 2 and sid not in m.replay.closed
    finally:
        await a.stop()
        await b.stop()


async def test_a_reopen_queued_behind_a_close_is_refused_as_closed(key_set, tmp_path):
    v = await Verifier(make_config(key_set, tmp_path / "wal"), key_set, FakeBackend).start()
    try:
        c = v.client(PARAMS)
        await c.open_session()
        lock = v.manager.lock(c.session_id)
        await lock.acquire()  # a round in progress
        close = asyncio.ensure_future(close_call(v, c))
        await asyncio.sleep(0.05)
        reopen = asyncio.ensure_future(c.open_session())
        await asyncio.sleep(0.1)
        lock.release()
        await close
        seq = v.wal_seq
        details = await refused(v, reopen, C.FAILED_PRECONDITION, "session_closed")
        assert "was closed" in details and v.wal_seq == seq
    finally:
        await v.stop()


async def test_a_cancelled_idle_sweep_leaves_the_session_closed_or_open_not_between(
    key_set, tmp_path
):
    v, clock = await started(key_set, tmp_path, session_idle_s=60)
    try:
        c = v.client(PARAMS)
        await c.open_session()
        stream = await c.attach()
        await c.run(stream, rounds=1)
        sid, m = c.session_id, v.manager
        seq = v.wal_seq
        clock.now += 61
        sweep = asyncio.ensure_future(m.close_idle())
        await asyncio.sleep(0)  # into the CLOSE's append
        sweep.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweep
        await asyncio.sleep(0.2)  # the close it began goes on to the end
        assert v.wal_seq == seq + 1
        assert sid in m.replay.closed and sid not in m._locks
        msg, _ = await stream.round_trip(c.sign(c.draft_request()))
        assert msg.error.reason == "session_closed" and v.wal_seq == seq + 1
        await restarts_closed(v, sid)
    finally:
        await v.stop()


async def test_a_sweep_does_not_remake_the_lock_of_a_session_closed_meanwhile(
    key_set, tmp_path, monkeypatch
):
    v, clock = await started(key_set, tmp_path, session_idle_s=60)
    try:
        first, second = v.client(PARAMS), v.client(PARAMS)
        for client in (first, second):
            await client.open_session()
        clock.now += 61
        m, gate, appended = v.manager, asyncio.Event(), []
        append = m.log.append_async

        async def slow_first(payload):
            appended.append(payload)
            if len(appended) == 1:
                await gate.wait()
            return await append(payload)

        monkeypatch.setattr(m.log, "append_async", slow_first)
        sweep = asyncio.ensure_future(m.close_idle())
        await asyncio.sleep(0.05)  # the sweep is in the first session's CLOSE
        await m._journal_close(second.session_id)  # the second's proposer closes it
        gate.set()
        assert await sweep == [first.session_id]
        assert len(appended) == 2
        assert second.session_id not in m._locks and first.session_id not in m._locks
    finally:
        await v.stop()
