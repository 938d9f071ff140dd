"""Requests sent on the early decision of the round before them (lane.send_on_decision):
the head predicted from a decision is the one the verifier's result carries, the journal
replays a request journaled ahead (in flight once the round before commits to the head it
expects, void otherwise), and a proposer restarted between the two finishes the session with
the same tokens (proposer_mac/journal.py, proposer_mac/send_ahead.py)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import wal
from muser.canonical import Writer
from muser.errors import RefusedError
from muser.records import RoundRequest, Signed
from muser.sampling import SamplingParams
from muser_app.lanes.local import run_local
from proposer_mac import journal
from tests.core.fake_backend import FakeBackend
from tests.proposer.restart import proposer_again
from tests.proposer.test_generate_service import start, stop
from tests.verifier.conftest import PROMPT

pytestmark = pytest.mark.asyncio

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=40, seed=5)


def entries(records) -> list[tuple[str, int | None]]:
    out = []
    for r in records:
        e = journal.describe(r.payload)
        out.append((e["entry"], e.get("round")))
    return out


def twin() -> FakeBackend:
    """A draft that is the target's twin: every draft is accepted and every bonus guessed,
    so every speculation holds and is ready when its decision comes (only those go ahead)."""
    return FakeBackend()


async def run_one(key_set, tmp_path, params, target=FakeBackend, **lane):
    """One session to the end with requests sent ahead; its runner and journal records."""
    c = await start(
        key_set, tmp_path, lane={"send_on_decision": True, **lane}, draft=twin(), target=target
    )
    try:
        runner = await c.server.core.start_session(PROMPT, params)
        await runner.task
        return runner, list(c.server.core.log.records()), c.verifier.manager.stats
    finally:
        await stop(c)


@pytest.mark.parametrize("capture", [False, True], ids=["plain", "capturing"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t1"])
async def test_every_request_ahead_expects_the_head_its_round_before_committed(
    key_set, tmp_path, params, capture
):
    """Each decision predicts its result's head exactly: the requests that went out on the
    decision before them (their PREPARED durable before that round's COMMITTED) were all
    taken, none was void, and the tokens are the local lane's. A capturing session's
    decision names its capture fragments' digests, so its requests go ahead too."""
    from tests.verifier.conftest import CaptureBackend

    lane = {"capture_layers": [1, 0]} if capture else {}  # out of order: fragments come in
    # layer order, which the proposer read in the session's order until session 32
    runner, records, verifier = await run_one(
        key_set, tmp_path, params, CaptureBackend if capture else FakeBackend, **lane
    )
    assert runner.session.open.capture_layers == ((1, 0) if capture else ())
    local = run_local(FakeBackend(), twin(), PROMPT, params, q_top_k=32)
    stats = runner.stats
    assert runner.error is None and runner.session.emitted == local.tokens
    assert stats.sent_ahead > 0 and stats.ahead_void == 0  # (how many: timing)
    assert verifier.rounds == stats.rounds and verifier.retries == 0
    order = [e for e in entries(records) if e[0] in ("prepared", "committed")]
    went = [
        r
        for r in range(stats.rounds - 1)
        if order.index(("prepared", r + 1)) < order.index(("committed", r))
    ]
    assert len(went) == stats.sent_ahead
    assert journal.WalInterpreter().check_chain(records, [], None) is None


async def test_decode_rounds_send_nothing_ahead(key_set, tmp_path):
    """A lane at D = 0 (the verifier decodes) drafts nothing ahead, so nothing goes ahead:
    each decode request follows its round's result, and the tokens are the local lane's."""
    from muser.width import FixedWidth

    runner, _, _ = await run_one(key_set, tmp_path, SAMPLED, draft_len=0, decode_len=4)
    width = FixedWidth(0, 4)
    local = run_local(FakeBackend(), twin(), PROMPT, SAMPLED, width=width)
    assert runner.error is None and runner.session.emitted == local.tokens
    assert runner.stats.rounds == 10 and runner.stats.sent_ahead == 0


def ahead_run(records) -> tuple[list, int, int]:
    """The payloads, the index of the first PREPARED journaled ahead of the COMMITTED of
    the round before it, and its round."""
    payloads, kinds = [r.payload for r in records], entries(records)
    for i, (kind, r) in enumerate(kinds[:-1]):
        if kind == "prepared" and kinds[i + 1] == ("committed", r - 1):
            return payloads, i, r
    raise AssertionError("no request went ahead")


async def test_replay_takes_a_request_ahead_once_the_round_before_commits(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i, r = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    before = journal.replay(payloads[: i + 1])[sid]  # a crash between the two
    assert before.prepared is not None and len(before.committed) == r - 1
    assert before.ahead is not None and request_round(before.ahead) == r
    after = journal.replay(payloads[: i + 2])[sid]
    assert len(after.committed) == r and after.ahead is None
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
    payloads, i, r = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    real = journal.replay(payloads[: i + 1])[sid].ahead
    void = journal.encode_prepared(sid, r, void_of(real, key_set.proposer))
    cut = [*payloads[:i], void, payloads[i + 1]]  # the void one ahead, then COMMITTED r-1
    s = journal.replay(cut)[sid]
    assert len(s.committed) == r and s.prepared is None and s.ahead is None
    s = journal.replay([*cut, payloads[i]])[sid]  # round r drafted again, journaled after
    assert s.prepared == real
    rest = journal.replay([*cut, payloads[i], *payloads[i + 2 :]])[sid]
    assert rest.done and rest == journal.replay(payloads)[sid]


async def test_replay_refuses_a_request_that_is_not_the_next_or_the_one_after(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i, r = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    ahead = journal.replay(payloads[: i + 1])[sid].ahead
    two_ahead = journal.encode_prepared(sid, r + 1, ahead)
    with pytest.raises(ValueError, match=f"round {r + 1} prepared after {r - 1} committed"):
        journal.replay([*payloads[:i], two_ahead])
    alone = journal.encode_prepared(sid, 1, ahead)  # ahead of a round never prepared
    with pytest.raises(ValueError, match="round 1 prepared after 0 committed"):
        journal.replay([payloads[0], alone])


async def test_snapshots_keep_the_request_ahead_and_old_snapshots_still_read(key_set, tmp_path):
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i, _ = ahead_run(records)
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
    # written before sessions said whether their client can reconnect: read as resumable
    w = Writer(journal.SNAPSHOT_DOMAIN_2).u32(1)
    w.blob(s.open.encode()).u64(s.epoch).u32s(s.prompt).u32(s.draft_len)
    w.blobs(c.encode() for c in s.committed).blob(s.prepared.encode())
    w.blob(s.ahead.encode() if s.ahead is not None else b"").u32(0)
    assert journal.decode_snapshot(w.bytes()) == {sid: s} and not s.detached
    detached = {sid: dataclasses.replace(s, detached=True)}
    assert journal.decode_snapshot(journal.snapshot_of(detached, 10)) == detached
    with pytest.raises(RefusedError, match="proposer-journal-snapshot-4"):
        journal.decode_snapshot(Writer("something-else").bytes())


@contextlib.asynccontextmanager
async def proposer_on(config, c, journal_dir):
    """A proposer daemon on `c`'s verifier with its journal in `journal_dir`."""
    config = config.model_copy(
        update={"proposer": config.proposer.model_copy(update={"wal_dir": journal_dir})}
    )
    async with proposer_again(config, c, draft=twin()) as core:
        yield core


async def _left_open(self, session) -> None:
    pass


@pytest.mark.parametrize("extra", [0, 1], ids=["before-commit", "after-commit"])
async def test_a_proposer_restarted_around_a_request_ahead_finishes_the_same(
    key_set, tmp_path, extra
):
    """Cut the journal right after PREPARED r went ahead (COMMITTED r-1 not durable), or
    right after COMMITTED r-1: a proposer restarted on it re-sends what is in flight, the
    verifier answers from its WAL, and the session ends with the uncrashed run's tokens,
    none repeated, with no round drafted twice."""
    from proposer_mac.context import DriverContext

    c = await start(key_set, tmp_path, lane={"send_on_decision": True}, draft=twin())
    try:
        close = DriverContext.close_remote
        DriverContext.close_remote = _left_open  # as a crash leaves it on the verifier
        try:
            runner = await c.server.core.start_session(PROMPT, GREEDY)
            await runner.task
        finally:
            DriverContext.close_remote = close
        records = list(c.server.core.log.records())
        payloads, i, r = ahead_run(records)
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
            assert resumed.stats.rounds == runner.stats.rounds - r + (1 - extra)
            records = list(core.log.records())
        assert c.verifier.manager.stats.retries > before  # answered from its WAL
        assert journal.WalInterpreter().check_chain(records, [], None) is None
        kinds = entries(records)
        assert kinds.count(("prepared", r)) == 1  # round r was not drafted again
    finally:
        await stop(c)


async def test_a_request_ahead_on_a_head_the_result_does_not_carry_is_void(
    key_set, tmp_path, monkeypatch
):
    """Every request goes ahead on a wrong head (as after a decision the result
    contradicts): the verifier refuses each and writes nothing, the proposer drops that
    stream, drafts the round again and journals its PREPARED after the void one; the
    tokens are the local lane's and the journal checks."""
    from proposer_mac.session import ProposerSession

    predict = ProposerSession.predict

    def wrong_head(self, *args):
        outcome = predict(self, *args)
        return outcome and dataclasses.replace(outcome, head=b"\x07" * 32)

    monkeypatch.setattr(ProposerSession, "predict", wrong_head)
    runner, records, verifier = await run_one(key_set, tmp_path, GREEDY)
    local = run_local(FakeBackend(), twin(), PROMPT, GREEDY, q_top_k=32)
    stats = runner.stats
    assert runner.error is None and runner.session.emitted == local.tokens
    assert stats.ahead_void == stats.sent_ahead > 0
    assert verifier.rounds == stats.rounds  # none of them was committed
    kinds = entries(records)
    twice = [r for r in range(stats.rounds) if kinds.count(("prepared", r)) == 2]
    assert len(twice) == stats.sent_ahead  # each void one, then the one drafted again
    for r in twice:  # the void one went before COMMITTED r-1, the other after it
        first = kinds.index(("prepared", r))
        second = kinds.index(("prepared", r), first + 1)
        assert first < kinds.index(("committed", r - 1)) < second
    replayed = journal.replay(r.payload for r in records)[runner.session.session_id]
    assert replayed.done and len(replayed.committed) == stats.rounds
    assert journal.WalInterpreter().check_chain(records, [], None) is None


async def test_a_move_drops_the_request_ahead_and_replays_the_new_epoch_and_home(key_set, tmp_path):
    """MOVED (proposer_mac.pool): the session's epoch and verifier change, the request
    journaled ahead (sent to the verifier left) is dropped, the request in flight is the
    one journaled after MOVED; a MOVED to a lower epoch is refused; snapshots keep where
    the session lived, and a snapshot from before pools reads with none."""
    _, records, _ = await run_one(key_set, tmp_path, GREEDY)
    payloads, i, r = ahead_run(records)
    sid = next(iter(journal.replay(payloads[:1])))
    before = journal.replay(payloads[: i + 1])[sid]
    assert before.ahead is not None and before.homes == []
    moved = [journal.encode_moved(sid, 1, "verifier"), journal.encode_moved(sid, 3, "b")]
    again = dataclasses.replace(RoundRequest.decode(before.prepared.body), epoch=3)
    resigned = Signed(again.encode(), b"\0" * 64)
    prepared = journal.encode_prepared(sid, r - 1, resigned)
    after = journal.replay([*payloads[: i + 1], *moved, prepared])[sid]
    assert (after.epoch, after.homes, after.ahead) == (3, ["verifier", "b"], None)
    assert after.prepared == resigned
    assert journal.describe(moved[1]) == {
        "entry": "moved", "session": sid.hex(), "epoch": 3, "verifier": "b"
    }  # fmt: skip
    with pytest.raises(ValueError, match="moved to epoch 2 below epoch 3"):
        journal.replay([*payloads[: i + 1], *moved, journal.encode_moved(sid, 2, "c")])
    sessions = journal.replay([*payloads[: i + 1], *moved, prepared])
    assert journal.decode_snapshot(journal.snapshot_of(sessions, 10)) == sessions
    s = sessions[sid]  # as snapshot 3 wrote it: no verifiers named
    w = Writer(journal.SNAPSHOT_DOMAIN_3).u32(1)
    w.blob(s.open.encode()).u64(s.epoch).u32s(s.prompt).u32(s.draft_len)
    w.blobs(c.encode() for c in s.committed).blob(s.prepared.encode()).blob(b"").u32(0).u32(0)
    assert journal.decode_snapshot(w.bytes()) == {sid: dataclasses.replace(s, homes=[])}
