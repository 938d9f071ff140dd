"""A session that fails for good mid-way (a result that does not check, a refusal, a draft
that fails): FAILED is journaled, so no restart resumes it and a client that reconnects is
told it failed, and the session lets go of its slot on the verifier
(proposer_mac.driver.SessionRunner._fail)."""

from __future__ import annotations

import asyncio

import pytest

from muser.sampling import SamplingParams
from proposer_mac import journal
from proposer_mac.session import ProposerSession, ResultRejected, SessionFailed
from tests.proposer.test_generate_service import start, stop
from tests.proposer.test_open_failure import restarted, stop_proposer
from tests.verifier.conftest import PROMPT

pytestmark = pytest.mark.asyncio

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=5)


def reject_round(monkeypatch, round_: int) -> None:
    """Results of round `round_` do not check out."""
    real = ProposerSession.check_result

    def check(self, request, signed, verifiers):
        if self.next_round == round_:
            raise ResultRejected(f"injected: round {round_}'s result does not check")
        return real(self, request, signed, verifiers)

    monkeypatch.setattr(ProposerSession, "check_result", check)


async def test_a_failed_session_is_never_resumed_and_a_reconnect_is_told(
    key_set, tmp_path, monkeypatch
):
    """Regression: nothing was journaled when a session failed after its open, so every
    restart resumed it, generating for nobody (or for a client told it had failed)."""
    c = await start(key_set, tmp_path)
    try:
        core = c.server.core
        reject_round(monkeypatch, 2)
        runner = await core.start_session(PROMPT, PARAMS)
        await runner.task
        assert isinstance(runner.error, ResultRejected)
        sid, durable = runner.session.session_id, runner.durable
        assert durable > 0 and runner.session.next_round == 2
        last = journal.describe(list(core.log.records())[-1].payload)
        assert last == {
            "entry": "failed",
            "session": sid.hex(),
            "reason": "injected: round 2's result does not check",
        }
        for _ in range(200):  # closed on the verifier in the background, once FAILED is durable
            if sid in c.verifier.manager.replay.closed:
                break
            await asyncio.sleep(0.01)
        assert sid in c.verifier.manager.replay.closed  # its verifier slot is free
        replayed = core._replayed()
        assert replayed[sid].done and replayed[sid].failed.startswith("injected")
        assert sid not in journal.retained(replayed, keep_finished=10)  # no snapshot keeps it
        monkeypatch.undo()
        await stop_proposer(c)
        async with restarted(c) as again:
            (recovered,) = again.runners.values()
            assert recovered.task is None  # not resumed
            tokens, finished = await recovered.wait_tokens(0)
            assert tokens == runner.session.emitted[:durable] and not finished
            with pytest.raises(SessionFailed, match="failed: injected: round 2's result"):
                await recovered.wait_tokens(durable)
    finally:
        await c.verifier.stop()


async def test_a_failed_session_lets_go_of_its_verifier_slot(key_set, tmp_path, monkeypatch):
    """Regression: a failed session stayed open on the verifier (its stream held by the
    error's traceback) until the idle sweep, an hour by default; with limits.max_sessions
    taken by failed sessions every new open was refused."""
    c = await start(key_set, tmp_path, max_sessions=1)
    try:
        core = c.server.core
        reject_round(monkeypatch, 1)
        failed = await core.start_session(PROMPT, PARAMS)
        await failed.task
        assert isinstance(failed.error, ResultRejected)
        assert failed.error.__traceback__ is None  # kept without the frames that hold a stream
        sid = failed.session.session_id
        for _ in range(200):  # closed in the background once FAILED is durable, not at once
            if sid in c.verifier.manager.replay.closed:
                break
            await asyncio.sleep(0.01)
        monkeypatch.undo()
        second = await core.start_session(PROMPT, PARAMS)  # the one slot is free again
        await second.task
        assert second.error is None and len(second.session.emitted) == PARAMS.max_tokens
    finally:
        await stop(c)
