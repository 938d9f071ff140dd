"""Requests sent on the early decision of the round before them (lane.send_on_decision):
the head predicted from a decision is the one the verifier's result carries, the journal
replays a request journaled ahead (in flight once the round before commits to the head it
expects, void otherwise), and a proposer restarted between the two finishes the session with
the same tokens (proposer_mac/journal.py, proposer_mac/driver.py `_send_ahead`)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import wal
from muser.canonical import Writer
from muser.errors import RefusedError
from muser.records import RoundRequest, Signed
from muser.sampling import SamplingParams
from proposer_mac import journal
from proposer_mac.daemon import create_server
from proposer_mac.local_lane import run_local
from tests.core.fake_backend import FakeBackend
from tests.proposer.test_generate_service import CharTokenizer, start, stop
from tests.verifier.conftest import PROMPT
from tests.verifier.lane_client import identity_of

pytestmark = pytest.mark.asyncio

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=40, seed=5)


def entries(records) -> list[tuple[str, int | None]]:
    out = []
    for r in records:
        e = journal.describe(r.payload)
        out.append((e["entry"], e.get("round")))
    return out


async def run_one(key_set, tmp_path, params, **lane):
    """One session to the end with requests sent ahead; its runner and journal records."""
    c = await start(key_set, tmp_path, lane={"send_on_decision": True, **lane})
    try:
        runner = await c.server.core.start_session(PROMPT, params)
        await runner.task
        return runner, list(c.server.core.log.records()), c.verifier.manager.stats
    finally:
        await stop(c)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t1"])
async def test_every_request_ahead_expects_the_head_its_round_before_committed(
    key_set, tmp_path, params
):
    """Each decision predicts its result's head exactly: every round after the first went
    out on the decision before it, none was void, and the tokens are the local lane's."""
    runner, records, verifier = await run_one(key_set, tmp_path, params)
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, q_top_k=32)
    stats = runner.stats
    assert runner.error is None and runner.session.emitted == local.tokens
    assert stats.sent_ahead == stats.rounds - 1 > 0 and stats.ahead_void == 0
    assert verifier.rounds == stats.rounds and verifier.retries == 0
    order = [e for e in entries(records) if e[0] in ("prepared", "committed")]
    for r in range(stats.rounds - 1):  # PREPARED r+1 is durable before COMMITTED r
        assert order.index(("prepared", r + 1)) < order.index(("committed", r))
    assert journal.WalInterpreter().check_chain(records, [], None) is None


async def test_decode_rounds_send_nothing_ahead(key_set, tmp_path):
    """A lane at D = 0 (the verifier decodes) drafts nothing ahead, so nothing goes ahead:
    each decode request follows its round's result, and the tokens are the local lane's."""
    from muser.width import FixedWidth

    runner, _, _ = await run_one(key_set, tmp_path, SAMPLED, draft_len=0, decode_len=4)
    width = FixedWidth(0, 4)
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, SAMPLED, width=width)
    assert runner.error is None and runner.session.emitted == local.tokens
    assert runner.stats.rounds == 10 and runner.stats.sent_ahead == 0


def ahead_run(records) -> tuple[list, int]:
    """The payloads and the index of the first PREPARED journaled ahead of its round's
    predecessor's COMMITTED (round 1's, before COMMITTED 0)."""
    payloads = [r.payload for r in records]
    return payloads, entries(records).index(("prepared", 1))


async def test_replay_takes_a_request_ahead_once_the_round_before_commits(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i = ahead_run(records)
    assert entries(records)[i + 1] == ("committed", 0)
    sid = next(iter(journal.replay(payloads[:1])))
    before = journal.replay(payloads[: i + 1])[sid]  # a crash between the two
    assert before.prepared is not None and len(before.committed) == 0
    assert before.ahead is not None and request_round(before.ahead) == 1
    after = journal.replay(payloads[: i + 2])[sid]
    assert len(after.committed) == 1 and after.ahead is None
    assert after.prepared == before.ahead  # the request ahead is now the one in flight


def request_round(signed: Signed) -> int:
    return RoundRequest.decode(signed.body).round


def void_of(signed: Signed, key) -> Signed:
    """The same request expecting another head: what a decision the result contradicts
    leaves in the journal."""
    request = RoundRequest.decode(signed.body)
    return Signed.of(dataclasses.replace(request, expected_head=b"\x07" * 32), key.sign)


async def test_a_request_ahead_on_another_head_is_void_and_the_next_one_takes_its_place(
    key_set, tmp_path
):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    real = journal.replay(payloads[: i + 1])[sid].ahead
    void = journal.encode_prepared(sid, 1, void_of(real, key_set.proposer))
    cut = [*payloads[:i], void, payloads[i + 1]]  # the void one ahead, then COMMITTED 0
    s = journal.replay(cut)[sid]
    assert len(s.committed) == 1 and s.prepared is None and s.ahead is None
    s = journal.replay([*cut, payloads[i]])[sid]  # round 1 drafted again, journaled after
    assert s.prepared == real
    rest = journal.replay([*cut, payloads[i], *payloads[i + 2 :]])[sid]
    assert rest.done and rest == journal.replay(payloads)[sid]


async def test_replay_refuses_a_request_that_is_not_the_next_or_the_one_after(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    ahead = journal.replay(payloads[: i + 1])[sid].ahead
    two_ahead = journal.encode_prepared(sid, 2, ahead)
    with pytest.raises(ValueError, match="round 2 prepared after 0 committed"):
        journal.replay([*payloads[:i], two_ahead])
    alone = journal.encode_prepared(sid, 1, ahead)  # ahead of a round never prepared
    with pytest.raises(ValueError, match="round 1 prepared after 0 committed"):
        journal.replay([payloads[0], alone])


async def test_snapshots_keep_the_request_ahead_and_old_snapshots_still_read(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i = ahead_run(records)
    sessions = journal.replay(payloads[: i + 1])
    assert journal.decode_snapshot(journal.snapshot_of(sessions, 10)) == sessions
    sid, s = next(iter(sessions.items()))
    # written before requests went ahead: no ahead field, another domain
    w = Writer(journal.SNAPSHOT_DOMAIN_1).u32(1)
    w.blob(s.open.encode()).u64(s.epoch).u32s(s.prompt).u32(s.draft_len)
    w.blobs(c.encode() for c in s.committed).blob(s.prepared.encode()).u32(0)
    old = journal.decode_snapshot(w.bytes())
    assert old == {sid: dataclasses.replace(s, ahead=None)}
    broken = {sid: dataclasses.replace(s, prepared=None)}  # ahead of nothing in flight
    with pytest.raises(RefusedError, match="a request ahead with none in flight"):
        journal.decode_snapshot(journal.snapshot_of(broken, 10))
    with pytest.raises(RefusedError, match="proposer-journal-snapshot-2"):
        journal.decode_snapshot(Writer("something-else").bytes())


@contextlib.asynccontextmanager
async def proposer_on(config, c, journal_dir):
    """A proposer daemon on `c`'s verifier with its journal in `journal_dir`."""
    config = config.model_copy(
        update={"proposer": config.proposer.model_copy(update={"wal_dir": journal_dir})}
    )
    server, _ = await create_server(
        config,
        draft=FakeBackend(order=1, salt=1),
        target_identity=identity_of(c.verifier.backend),
        tokenizer=CharTokenizer(),
    )
    try:
        yield server.core
    finally:
        await server.stop(None)
        server.core.log.close()


async def _left_open(self, session) -> None:
    pass


@pytest.mark.parametrize("extra", [0, 1], ids=["before-commit", "after-commit"])
async def test_a_proposer_restarted_around_a_request_ahead_finishes_the_same(
    key_set, tmp_path, extra
):
    """Cut the journal right after PREPARED 1 went ahead (COMMITTED 0 not durable), or
    right after COMMITTED 0: a proposer restarted on it re-sends what is in flight, the
    verifier answers from its WAL, and the session ends with the uncrashed run's tokens,
    none repeated, with no round drafted twice."""
    from proposer_mac.driver import DriverContext

    c = await start(key_set, tmp_path, lane={"send_on_decision": True})
    try:
        close = DriverContext.close_remote
        DriverContext.close_remote = _left_open  # as a crash leaves it on the verifier
        try:
            runner = await c.server.core.start_session(PROMPT, GREEDY)
            await runner.task
        finally:
            DriverContext.close_remote = close
        records = list(c.server.core.log.records())
        payloads, i = ahead_run(records)
        cut_dir = tmp_path / f"cut{extra}"
        log = wal.FileLog(cut_dir / "journal")
        for payload in payloads[: i + 1 + extra]:
            log.append(payload)
        log.close()
        config = c.server.core.config
        before = c.verifier.manager.stats.retries
        async with proposer_on(config, c, cut_dir) as core:
            (resumed,) = core.runners.values()
            await resumed.task
            assert resumed.error is None
            assert resumed.session.emitted == runner.session.emitted
            assert resumed.stats.rounds == runner.stats.rounds - 1 + (1 - extra)
            records = list(core.log.records())
        assert c.verifier.manager.stats.retries > before  # answered from its WAL
        assert journal.WalInterpreter().check_chain(records, [], None) is None
        kinds = entries(records)
        assert kinds.count(("prepared", 1)) == 1  # round 1 was not drafted again
    finally:
        await stop(c)
