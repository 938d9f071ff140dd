"""Lookahead: the verifier evaluates a round the proposer named ahead of its request, and the
request that names the same tokens takes those rows instead of a forward. A hint only: the
decisions, the results and the WAL are what they are without it.

Executor level on a tiny torch checkpoint (per-session KV, batched forwards): the rows taken
are bit-equal to a forward made for the request, a mixed batch computes only the rounds
without one, a contradicted lookahead is a forward as ever, and a lookahead never rebuilds
a KV. Verifier level over loopback (the fake target, one shared KV): sessions emit the local
lane's tokens with a lookahead on every round, a wrong one changes nothing, one that does
not name the next round after what the round before emitted is ignored, the stream's
Lookahead serves the request after it, of the guesses sent behind a request only the one
that held runs, none runs while another session's round is in progress, the stream is read while
a round is in progress (a hint starts then), hints beyond a bound are dropped, and a stream
that fails ends the round loop with its error.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from muser.records import RoundResult
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import PROMPT
from verifier_gx.executor import TargetExecutor, witness_batch
from verifier_gx.servicer import HINTS, VerifierServicer

GREEDY = SamplingParams(temperature=0.0, max_tokens=30)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=30, seed=5)
TRANSCRIPT = [2, 9, 4, 7, 1]


@pytest.fixture(scope="module")
def torch_target(tmp_path_factory):
    from muser_app.testing import make_tiny_checkpoint
    from muser_torch.backend import TorchBackend

    return TorchBackend(make_tiny_checkpoint(tmp_path_factory.mktemp("ahead") / "m", layers=2))


@pytest.fixture
def forwards(torch_target, monkeypatch):
    """The token lists of every batched forward from here on."""
    seen: list[list[list[int]]] = []
    real = torch_target.evaluate_batch

    def counting(work):
        seen.append([list(tokens) for _, tokens in work])
        return real(work)

    monkeypatch.setattr(torch_target, "evaluate_batch", counting)
    return seen


def ahead_of(torch_target, drafts) -> TargetExecutor:
    """An executor holding TRANSCRIPT[:-1] (as after its last round) that looked ahead."""
    ex = TargetExecutor(torch_target.sequence())
    ex.cursor.hold(TRANSCRIPT[:-1])
    assert ex.look_ahead(TRANSCRIPT, drafts, time.perf_counter) > 0
    return ex


def made_for_the_request(torch_target, transcript, drafts) -> np.ndarray:
    return witness_batch(torch_target, [(TargetExecutor(torch_target.sequence()), transcript,
                                         drafts)])[0]  # fmt: skip


def test_rows_named_ahead_are_the_rows_of_the_round_bit_for_bit(torch_target, forwards):
    ahead = ahead_of(torch_target, [3, 5])
    before = len(forwards)
    rows = witness_batch(torch_target, [(ahead, TRANSCRIPT, [3, 5])])[0]
    assert len(forwards) == before  # no forward of its own
    assert ahead.ahead_s > 0
    assert np.array_equal(rows, made_for_the_request(torch_target, TRANSCRIPT, [3, 5]))
    plain = TargetExecutor(torch_target.sequence())  # the same rounds without a lookahead
    witness_batch(torch_target, [(plain, TRANSCRIPT, [3, 5])])
    after = [*TRANSCRIPT, 3, 6]
    for ex in (ahead, plain):
        ex.settle(len(TRANSCRIPT), 1)  # the KV goes on as after any round
    again = witness_batch(torch_target, [(ahead, after, [2])])[0]
    assert np.array_equal(again, witness_batch(torch_target, [(plain, after, [2])])[0])
    assert ahead.ahead_s == 0  # spent: the next round had no lookahead


def test_a_batch_computes_only_the_rounds_without_a_lookahead(torch_target, forwards):
    ahead, plain = ahead_of(torch_target, [3, 5]), TargetExecutor(torch_target.sequence())
    other = [4, 4, 8]
    before = len(forwards)
    rows = witness_batch(torch_target, [(ahead, TRANSCRIPT, [3, 5]), (plain, other, [1])])
    # the plain round: its transcript held first, then its [frontier, drafts] alone
    assert forwards[before:] == [[other[:-1]], [[other[-1], 1]]]
    assert np.array_equal(rows[0], made_for_the_request(torch_target, TRANSCRIPT, [3, 5]))
    assert np.array_equal(rows[1], made_for_the_request(torch_target, other, [1]))


def test_a_lookahead_the_request_contradicts_is_a_forward_as_ever(torch_target, forwards):
    ahead = ahead_of(torch_target, [3, 5])
    before = len(forwards)
    rows = witness_batch(torch_target, [(ahead, TRANSCRIPT, [3, 6])])[0]
    assert forwards[before:] == [[[TRANSCRIPT[-1], 3, 6]]]
    assert ahead.ahead_s == 0
    assert np.array_equal(rows, made_for_the_request(torch_target, TRANSCRIPT, [3, 6]))
    moved = ahead_of(torch_target, [3, 5])
    moved.cursor.truncate(2)  # the KV moved since (as a capture or decode round moves it)
    assert moved.take_ahead(TRANSCRIPT, [3, 5]) is None


# ---- the verifier ----------------------------------------------------------------------------


def local_tokens(params: SamplingParams) -> list[int]:
    return run_local(
        FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, draft_len=3, q_top_k=5
    ).tokens


def emission(client) -> list[int]:
    """What the client's last round emitted (the prompt's last token before any round)."""
    if not client.results:
        return [client.transcript[-1]]
    return list(RoundResult.decode(client.results[-1].body).emitted())


async def session(verifier, params, tamper=None) -> tuple[object, list[tuple[bool, bool]]]:
    """A whole session, each round named ahead through the manager first (`tamper` alters
    the drafts named). Returns the client and, per round, whether its lookahead ran and
    whether it had drafts to name."""
    client = verifier.client(params, draft_len=3, q_top_k=5)
    await client.open_session()
    stream = await client.attach()
    ran = []
    while not client.done:
        request = client.draft_request()
        named = list(request.drafts) if tamper is None else tamper(list(request.drafts))
        went = await verifier.manager.look_ahead(
            client.session_id, request.round, emission(client), named
        )
        ran.append((went, bool(request.drafts)))
        msg, _ = await stream.round_trip(client.sign(request))
        client.accept(request, msg)
    await stream.close()
    return client, ran


@pytest.mark.asyncio
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
async def test_rounds_named_ahead_emit_the_local_lane_tokens(verifier, params):
    client, ran = await session(verifier, params)
    assert client.out == local_tokens(params)
    # round 0 has no KV held yet (a hint never builds one); every later round with drafts
    # ran ahead (a round without drafts, at the end, has nothing to name)
    assert [went for went, _ in ran] == [r > 0 and drafted for r, (_, drafted) in enumerate(ran)]
    stats = verifier.manager.stats
    assert stats.lookaheads == stats.lookahead_hits == sum(went for went, _ in ran) > 10
    assert stats.lookahead_s > 0


@pytest.mark.asyncio
async def test_a_wrong_lookahead_changes_no_token(verifier):
    client, ran = await session(verifier, SAMPLED, tamper=lambda d: [(t + 1) % 24 for t in d])
    assert client.out == local_tokens(SAMPLED)
    stats = verifier.manager.stats
    assert stats.lookaheads == sum(went for went, _ in ran) > 10 and stats.lookahead_hits == 0


@pytest.mark.asyncio
async def test_guesses_sent_before_the_decision_run_only_the_one_that_held(verifier):
    """As the proposer does while a round is away: one lookahead per guess of what it
    emits, on the stream behind its request; once it is committed only the right one runs."""
    reference, _ = await session(verifier, GREEDY)  # the same rounds: same prompt and params
    rounds = [RoundResult.decode(r.body) for r in reference.results]
    verifier.manager.stats.lookaheads = verifier.manager.stats.lookahead_hits = 0
    client = verifier.client(GREEDY, draft_len=3, q_top_k=5)
    await client.open_session()
    stream = await client.attach()
    for r, expected in enumerate(rounds):
        request = client.draft_request()
        await stream.send(request=client.sign(request))
        if r + 1 < len(rounds) and rounds[r + 1].drafts:
            right = list(expected.emitted())
            for after in ([*right[:-1], (right[-1] + 1) % 24], right, [7] * (len(right) + 90)):
                ahead = pb.Lookahead(round=r + 1, after=after, drafts=list(rounds[r + 1].drafts))
                await stream.send(lookahead=ahead)
        while (msg := await stream.read()).WhichOneof("kind") != "result":
            assert msg.WhichOneof("kind") == "decision"
        client.accept(request, msg)
    await stream.close()
    assert client.out == reference.out
    named = sum(1 for x in rounds[1:] if x.drafts)
    stats = verifier.manager.stats
    assert stats.lookaheads == stats.lookahead_hits == named > 10


@pytest.mark.asyncio
async def test_a_lookahead_that_is_not_the_next_round_is_ignored(verifier):
    client = verifier.client(SAMPLED, draft_len=3, q_top_k=5)
    await client.open_session()
    stream = await client.attach()
    request = client.draft_request()
    msg, _ = await stream.round_trip(client.sign(request))
    client.accept(request, msg)
    nxt = client.draft_request()
    sid, before = client.session_id, verifier.snapshot(client.session_id)
    manager = verifier.manager
    remaining = SAMPLED.max_tokens - len(client.out)
    after, drafts = emission(client), list(nxt.drafts)
    for round_, guess, named in [
        (nxt.round + 1, after, drafts),  # not the next round
        (nxt.round - 1, after, drafts),  # a committed one
        (nxt.round, [*after[:-1], (after[-1] + 1) % 24], drafts),  # another emission
        (nxt.round, [5] * (len(client.transcript) + 1), drafts),  # longer than the transcript
        (nxt.round, [], drafts),  # no emission named
        (nxt.round, after, []),  # nothing to evaluate
        (nxt.round, after, [1] * remaining),  # more than the session has left
    ]:
        assert not await manager.look_ahead(sid, round_, guess, named)
    assert not await manager.look_ahead(b"\x07" * 16, nxt.round, after, drafts)  # unknown
    assert manager.stats.lookaheads == 0
    assert verifier.snapshot(sid) == before
    assert await manager.look_ahead(sid, nxt.round, after, drafts)
    assert not await manager.look_ahead(sid, nxt.round, after, [*drafts[:-1], 0])  # one a round
    assert manager.stats.lookaheads == 1 and verifier.snapshot(sid) == before
    msg, _ = await stream.round_trip(client.sign(nxt))  # the session goes on as ever
    client.accept(nxt, msg)
    await stream.close()


@pytest.mark.asyncio
async def test_the_stream_lookahead_serves_the_request_after_it(verifier):
    from verifier_gx.servicer import status_json

    client = verifier.client(GREEDY, draft_len=3, q_top_k=5)
    await client.open_session()
    stream = await client.attach()
    for named in (False, True):
        request = client.draft_request()
        if named:
            ahead = pb.Lookahead(
                round=request.round, after=emission(client), drafts=list(request.drafts)
            )
            await stream.send(lookahead=ahead)  # never answered: the next message is a result
        msg, _ = await stream.round_trip(client.sign(request))
        client.accept(request, msg)
    await stream.close()
    stats = verifier.manager.stats
    assert stats.lookaheads == stats.lookahead_hits == 1
    assert status_json(verifier.manager)["lookahead"]["hits"] == 1


@pytest.mark.asyncio
async def test_no_lookahead_runs_while_another_sessions_round_is_in_progress(key_set, tmp_path):
    """Rounds go first: while another session's round is at the verifier (here computing),
    a hint is not evaluated (it would hold the target from that session's next batch); once
    no other round is in progress the same hint runs. (A target with a KV per session: a
    hint never rebuilds one.)"""
    from tests.verifier.test_batching import SequencedFake, started, until

    v = await started(key_set, tmp_path, SequencedFake)
    try:
        manager = v.manager
        b, stream_b = await gated_session(v)
        request = b.draft_request()
        msg, _ = await stream_b.round_trip(b.sign(request))
        b.accept(request, msg)
        nxt = b.draft_request()
        hint = (b.session_id, nxt.round, emission(b), list(nxt.drafts))
        v.backend.gate.clear()  # the target holds every batch from here
        v.backend.entered.clear()
        a, stream_a = await gated_session(v)
        request_a = a.draft_request()
        await stream_a.send(request=a.sign(request_a))
        await until(v.backend.entered.is_set)
        assert not await manager.look_ahead(*hint)
        v.backend.gate.set()
        await read_result(a, stream_a, request_a)
        assert await manager.look_ahead(*hint)
        assert manager.stats.lookaheads == 1
        for stream in (stream_a, stream_b):
            await stream.close()
    finally:
        await v.stop()


async def gated_session(verifier):
    client = verifier.client(GREEDY, draft_len=3, q_top_k=5)
    await client.open_session()
    return client, await client.attach()


async def read_result(client, stream, request) -> None:
    while (msg := await stream.read()).WhichOneof("kind") != "result":
        assert msg.WhichOneof("kind") == "decision"
    client.accept(request, msg)


@pytest.mark.asyncio
async def test_a_hint_is_read_while_the_round_before_it_is_in_progress(verifier, monkeypatch):
    """A round that cannot finish before the hint sent behind it is read finishes: the
    stream is read beside the round in progress (read one message at a time, the hint would
    wait for the round's result and the round for the hint)."""
    manager = verifier.manager
    hinted = asyncio.Event()
    real_look_ahead, real_run_round = manager.look_ahead, manager.run_round

    async def look_ahead(*args):
        hinted.set()
        return await real_look_ahead(*args)

    async def run_round(signed, on_decided=None):
        await asyncio.wait_for(hinted.wait(), 10)
        return await real_run_round(signed, on_decided)

    monkeypatch.setattr(manager, "look_ahead", look_ahead)
    monkeypatch.setattr(manager, "run_round", run_round)
    client, stream = await gated_session(verifier)
    request = client.draft_request()
    await stream.send(request=client.sign(request))
    await stream.send(lookahead=pb.Lookahead(round=1, after=[1], drafts=[2]))
    await read_result(client, stream, request)
    await stream.close()
    assert hinted.is_set() and client.out


@pytest.mark.asyncio
async def test_hints_beyond_the_bound_are_dropped_not_queued(verifier, monkeypatch):
    manager = verifier.manager
    calls, counted, release = [], [], asyncio.Event()
    real_run_round = manager.run_round

    async def look_ahead(*args):  # a hint that waits, as one does behind a long round
        calls.append(args)
        await release.wait()
        return False

    async def run_round(signed, on_decided=None):  # the hints before it were all read
        counted.append(len(calls))
        release.set()
        return await real_run_round(signed, on_decided)

    monkeypatch.setattr(manager, "look_ahead", look_ahead)
    monkeypatch.setattr(manager, "run_round", run_round)
    client, stream = await gated_session(verifier)
    for sent in (3 * HINTS, 1):  # the second after the first ones ended: taken again
        request = client.draft_request()
        for _ in range(sent):
            hint = pb.Lookahead(round=request.round + 1, after=[1], drafts=[2])
            await stream.send(lookahead=hint)
        await stream.send(request=client.sign(request))
        await read_result(client, stream, request)
    await stream.close()
    assert counted == [HINTS, HINTS + 1]


class _Manager:
    """What `VerifierServicer.Rounds` asks of a manager before a round, recorded."""

    def __init__(self) -> None:
        self.acked: list[int] = []

    def attach(self, session_id: bytes, epoch: int) -> None:
        pass

    def ack(self, session_id: bytes, round_: int) -> None:
        self.acked.append(round_)


@pytest.mark.asyncio
async def test_a_stream_that_fails_ends_the_round_loop_with_its_error():
    sid = b"\x01" * 16

    async def messages():
        yield pb.ProposerMessage(attach=pb.Attach(session_id=sid, epoch=1))
        yield pb.ProposerMessage(ack=pb.Ack(session_id=sid, round=3))
        raise ConnectionResetError("the stream broke")

    manager = _Manager()
    with pytest.raises(ConnectionResetError, match="the stream broke"):
        async for _ in VerifierServicer(manager).Rounds(messages(), None):
            pass
    assert manager.acked == [3]  # what came before the failure was handled, in order


def test_a_lookahead_never_rebuilds_a_kv(torch_target, forwards):
    ex = TargetExecutor(torch_target.sequence())  # empty: as after an eviction or a restart
    before = len(forwards)
    assert ex.look_ahead(TRANSCRIPT, [3, 5], time.perf_counter) is None
    assert len(forwards) == before and ex.cursor.tokens == []
    assert ex.take_ahead(TRANSCRIPT, [3, 5]) is None
