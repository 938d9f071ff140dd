"""A session nothing uses for `limits.session_idle_s` is closed by the verifier itself: its
slot, KV and state are freed, its CLOSE is in the commit log, and a proposer that comes
back is refused (verifier_gx.sessions.SessionManager.close_idle)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from muser.sampling import SamplingParams
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config
from tests.verifier.test_open import refused
from verifier_gx import journal

pytestmark = pytest.mark.asyncio

PARAMS = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
C = grpc.StatusCode


class Clock:
    """The manager's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def started(key_set, tmp_path, **limits) -> tuple[Verifier, Clock]:
    v = await Verifier(make_config(key_set, tmp_path / "wal", **limits), key_set, FakeBackend).start()  # fmt: skip
    clock = Clock()
    v.manager.clock = clock
    return v, clock


async def test_only_the_sessions_left_idle_are_closed(key_set, tmp_path):
    v, clock = await started(key_set, tmp_path, session_idle_s=60)
    try:
        left, used, finished = (v.client(PARAMS) for _ in range(3))
        for client in (left, used, finished):
            await client.open_session()
        left_stream = await left.attach()
        await left.run(left_stream, rounds=2)
        await finished.run(await finished.attach())  # done, never closed by its proposer
        stream = await used.attach()
        clock.now += 59
        await used.run(stream, rounds=1)  # a round: it is in use
        forged = left.sign(left.draft_request(), key_set.stranger)
        msg, _ = await left_stream.round_trip(forged)  # refused: it keeps nothing alive
        assert msg.error.reason == "bad_signature"
        assert await v.manager.close_idle() == []  # 59 s is not 60
        clock.now += 1
        seq = v.wal_seq
        closed = await v.manager.close_idle()
        assert set(closed) == {left.session_id, finished.session_id}
        assert v.manager.stats.idle_closed == 2  # muser_idle_closed_total, `muser status`
        assert v.wal_seq == seq + 2
        records = [r.payload for r in v.manager.log.records(seq + 1)]
        assert [journal.decode(p) for p in records] == [journal.CloseEntry(sid) for sid in closed]
        assert set(v.manager.replay.closed) == set(closed)
        assert used.session_id in v.manager.replay.sessions
        await used.run(stream)  # the one in use goes on to the end
        assert len(used.out) == PARAMS.max_tokens

        # the proposer of a closed one comes back: refused, nothing written
        seq = v.wal_seq
        stream = await left.attach()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.round_trip(left.sign(left.draft_request()))
        assert err.value.code() == C.FAILED_PRECONDITION and "session_closed" in err.value.details()
        await refused(v, left.open_session(), C.FAILED_PRECONDITION, "session_closed")
        assert v.wal_seq == seq
    finally:
        await v.stop()

    again = await Verifier(make_config(key_set, tmp_path / "wal", session_idle_s=60), key_set, FakeBackend).start()  # fmt: skip
    try:  # the closes were journaled: a restart holds them closed
        assert set(again.manager.replay.closed) == set(closed)
    finally:
        await again.stop()


async def test_an_idle_session_frees_its_slot(key_set, tmp_path):
    v, clock = await started(key_set, tmp_path, session_idle_s=60, max_sessions=1)
    try:
        gone, waiting = v.client(PARAMS), v.client(PARAMS)
        await gone.open_session()
        await refused(v, waiting.open_session(), C.RESOURCE_EXHAUSTED, "max_sessions")
        clock.now += 60
        assert await v.manager.close_idle() == [gone.session_id]
        await waiting.open_session()
        await waiting.run(await waiting.attach())
        assert len(waiting.out) == PARAMS.max_tokens
    finally:
        await v.stop()


async def test_zero_never_closes(key_set, tmp_path):
    v, clock = await started(key_set, tmp_path, session_idle_s=0)
    try:
        client = v.client(PARAMS)
        await client.open_session()
        clock.now += 1e9
        assert await v.manager.close_idle() == []
        await asyncio.wait_for(v.manager.expire_idle(), 1)  # returns at once: nothing to run
        assert client.session_id in v.manager.replay.sessions
    finally:
        await v.stop()


async def test_the_running_daemon_closes_an_abandoned_session(key_set, tmp_path):
    """On the real clock: the server's own loop checks every quarter of session_idle_s."""
    v = await Verifier(make_config(key_set, tmp_path / "wal", session_idle_s=0.2), key_set, FakeBackend).start()  # fmt: skip
    try:
        client = v.client(PARAMS)
        await client.open_session()
        await client.run(await client.attach(), rounds=1)
        for _ in range(250):
            if client.session_id in v.manager.replay.closed:
                break
            await asyncio.sleep(0.02)
        assert client.session_id in v.manager.replay.closed
    finally:
        await v.stop()
