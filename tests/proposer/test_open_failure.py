"""A session whose open fails (the verifier refuses it or never answers) or whose caller
leaves mid-open: its OPEN is journaled first, so FAILED (or, for a caller gone, DONE) must
follow it, or a restarted daemon would resume a session nobody reads."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from muser.sampling import SamplingParams
from proposer_mac.context import DriverContext
from proposer_mac.link import LinkDown, RoundRefused
from proposer_mac.session import SessionFailed
from tests.proposer.restart import proposer_again
from tests.proposer.test_generate_service import PARAMS, start, stop
from tests.verifier.conftest import PROMPT

pytestmark = pytest.mark.asyncio

OVERFLOW = SamplingParams(temperature=1.0, max_tokens=4096, seed=5)
"""4 prompt tokens + 4096 - 1 > the fake target's 4096 positions: the verifier refuses."""


def journaled(core) -> dict:
    """{session id: done} as the journal replays (FAILED is done too)."""
    return {sid: js.done for sid, js in core._replayed().items()}


def told_it_failed(runner) -> bool:
    """A recovered session that failed: not resumed, and a reconnect is told why."""
    return runner.task is None and isinstance(runner.error, SessionFailed)


def restarted(c):
    """The proposer daemon started again on `c`'s config and journal (after it stopped)."""
    return proposer_again(c.server.core.config, c)


async def stop_proposer(c) -> None:
    await c.channel.close()
    await c.server.stop(None)
    await c.server.core.close()


async def test_an_open_the_verifier_refuses_is_done_and_never_resumed(key_set, tmp_path):
    c = await start(key_set, tmp_path)
    try:
        core = c.server.core
        with pytest.raises(RoundRefused, match="context window is 4096") as err:
            await core.start_session(PROMPT, OVERFLOW)
        assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
        with pytest.raises(grpc.aio.AioRpcError) as rpc:  # the gRPC front end: the same
            await c.generate(OVERFLOW, prompt_tokens=PROMPT)
        assert rpc.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert list(journaled(core).values()) == [True, True]  # OPEN, then FAILED, each
        assert core.runners == {}
        await stop_proposer(c)
        async with restarted(c) as again:
            assert list(again.runners) == list(journaled(again))
            assert all(told_it_failed(r) for r in again.runners.values())
            assert all("its open failed" in str(r.error) for r in again.runners.values())
            assert all(r.session.emitted == [] for r in again.runners.values())
    finally:
        await c.verifier.stop()


async def test_an_open_the_verifier_never_answers_is_done_and_never_resumed(
    key_set, tmp_path, monkeypatch
):
    import proposer_mac.context

    monkeypatch.setattr(proposer_mac.context, "OPEN_S", 1)
    c = await start(key_set, tmp_path)
    try:
        await c.verifier.stop()
        with pytest.raises(LinkDown, match="no answer from the verifier"):
            await c.server.core.start_session(PROMPT, PARAMS)
        assert list(journaled(c.server.core).values()) == [True]
        await stop_proposer(c)
        await c.verifier.start()  # the verifier is back: still, nothing is resumed
        async with restarted(c) as again:
            (runner,) = again.runners.values()
            assert told_it_failed(runner) and "no answer from the verifier" in str(runner.error)
    finally:
        await c.verifier.stop()


async def test_a_caller_that_leaves_mid_open_gets_a_session_that_ends_at_once(
    key_set, tmp_path, monkeypatch
):
    """The open goes on after its caller was cancelled (a client that disconnected); the
    session it opens ends before its first round, DONE journaled and closed on the verifier."""
    opening, release = asyncio.Event(), asyncio.Event()
    real_open = DriverContext.open_remote

    async def slow_open(self, session):
        opening.set()
        await release.wait()
        await real_open(self, session)

    monkeypatch.setattr(DriverContext, "open_remote", slow_open)
    c = await start(key_set, tmp_path)
    try:
        core = c.server.core
        caller = asyncio.create_task(core.start_session(PROMPT, PARAMS))
        await asyncio.wait_for(opening.wait(), 10)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        for _ in range(500):
            if core.runners and all(r.finished for r in core.runners.values()):
                break
            await asyncio.sleep(0.01)
        (runner,) = core.runners.values()
        await asyncio.wait_for(runner.task, 10)
        sid = runner.session.session_id
        assert runner.cancelled and runner.session.emitted == [] and runner.stats.rounds == 0
        assert journaled(core) == {sid: True}
        for _ in range(200):
            if sid in c.verifier.manager.replay.closed:
                break
            await asyncio.sleep(0.01)
        assert sid in c.verifier.manager.replay.closed
    finally:
        await stop(c)
