"""The proposer daemon in process, against an in-process verifier, on fake backends."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from muser.errors import RefusedError
from muser.sampling import SamplingParams
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from muser_app.lanes.local import run_local
from proposer_mac.daemon import create_server
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import PROMPT, Verifier, make_config
from tests.verifier.lane_client import identity_of


class CharTokenizer:
    """Enough of a tokenizer for event text: one character per token id."""

    def decode(self, tokens):
        return "".join(chr(65 + t % 26) for t in tokens)

    def __init__(self):
        self.encoded = 0
        """Characters tokenized so far: a refused prompt must add none."""

    def encode(self, text, add_special_tokens=False):
        self.encoded += len(text)
        return [ord(c) % 24 for c in text]

    def get_vocab(self):
        return {chr(65 + i): i for i in range(24)}  # no entry spells more than 1 byte


class Cluster:
    def __init__(self, verifier, server, port, channel):
        self.verifier, self.server, self.port, self.channel = verifier, server, port, channel
        self.stub = pb_grpc.ProposerStub(channel)

    async def generate(self, params: SamplingParams, **fields) -> list:
        request = pb.GenerateRequest(params=convert.params_to_pb(params), **fields)
        return [event async for event in self.stub.Generate(request)]


async def start(
    key_set,
    tmp_path,
    *,
    enrol_stranger=False,
    ask_identity=False,
    speculate=True,
    lane=None,
    draft=None,
    proposer=None,
    edit=None,
    target=FakeBackend,
    **limits,
):
    verifier = Verifier(make_config(key_set, tmp_path / "wal", **limits), key_set, target)
    await verifier.start()
    cfg = verifier.config
    d = key_set.dir
    enrolment = cfg.enrolment.model_copy(
        update={"verifiers": [d / ("stranger.pub" if enrol_stranger else "verifier.pub")]}
    )
    cfg = cfg.model_copy(
        update={
            "verifier": cfg.verifier.model_copy(update={"address": f"127.0.0.1:{verifier.port}"}),
            "proposer": cfg.proposer.model_copy(
                update={"address": "127.0.0.1:0", **(proposer or {})}
            ),
            "enrolment": enrolment,
            "lane": cfg.lane.model_copy(update={"speculate": speculate, **(lane or {})}),
        }
    )
    if edit is not None:  # the cluster file as the test wants it (a verifier pool, say)
        cfg = edit(cfg)
    server, port = await create_server(
        cfg,
        draft=draft or FakeBackend(order=1, salt=1),
        target_identity=None if ask_identity else identity_of(verifier.backend),
        tokenizer=CharTokenizer(),
    )
    return Cluster(verifier, server, port, grpc.aio.insecure_channel(f"127.0.0.1:{port}"))


@pytest_asyncio.fixture
async def cluster(key_set, tmp_path):
    c = await start(key_set, tmp_path, lane={"lookahead": "on"})  # hints on every path
    yield c
    await stop(c)


PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=5)


@pytest.mark.asyncio
async def test_generate_equals_the_local_lane_and_offsets_are_contiguous(cluster):
    events = await cluster.generate(PARAMS, prompt_tokens=PROMPT)
    tokens = [t for e in events for t in e.tokens]
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS, q_top_k=32)
    assert tokens == local.tokens
    offsets = [e.offset for e in events]
    assert offsets == [sum(len(e.tokens) for e in events[:i]) for i in range(len(events))]
    assert events[-1].done and events[-1].stats_json
    # the first event names the journaled session before any round: a client whose
    # proposer dies before the first tokens can reconnect to it
    assert not events[0].tokens and events[0].session_id and events[0].prompt_tokens == len(PROMPT)
    sid = events[0].session_id
    for _ in range(200):  # the runner closes the session on the verifier after its last event
        if sid in cluster.verifier.manager.replay.closed:
            break
        await asyncio.sleep(0.01)
    assert sid in cluster.verifier.manager.replay.closed


@pytest.mark.asyncio
async def test_reconnect_with_session_and_offset_gets_exactly_the_rest(cluster):
    events = await cluster.generate(PARAMS, prompt_tokens=PROMPT)
    tokens = [t for e in events for t in e.tokens]
    rest = await cluster.generate(PARAMS, session_id=events[0].session_id, offset=17)
    assert [t for e in rest for t in e.tokens] == tokens[17:]
    assert rest[0].offset == 17 and rest[-1].done


@pytest.mark.asyncio
async def test_unknown_session_is_not_found(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.generate(PARAMS, session_id=b"\x01" * 16)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown session 0101" in err.value.details()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "fields", "message"),
    [
        (SamplingParams(max_tokens=5000), {"prompt_tokens": PROMPT}, "exceeds the cluster limit"),
        (PARAMS, {"prompt_tokens": [1, 99]}, "prompt token 99 outside the vocabulary"),
        (PARAMS, {"prompt": ""}, "the prompt is empty"),
    ],
)
async def test_bad_requests_are_refused_with_what_was_wrong(cluster, params, fields, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.generate(params, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


@pytest.mark.asyncio
async def test_a_prompt_too_big_for_the_context_is_refused_before_it_is_tokenized(cluster):
    """Regression (issue 35): the prompt text of a Generate was tokenized on the event loop,
    whatever its size, stalling every other session's stream for seconds. Now a text whose
    byte count alone shows it cannot fit the context window is refused untokenized, and
    one that may fit is tokenized in a worker thread."""
    core = cluster.server.core
    core.target_context_length = 64  # CharTokenizer: no token spells more than 1 byte
    tokenizer = core.tokenizer
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.generate(PARAMS, prompt="x" * 65)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        "the prompt is 65 bytes of text; no token of this model spells more than 1 bytes, so "
        "it cannot fit the context window of 64 tokens (at most 64 bytes); nothing was tokenized"
    )
    assert tokenizer.encoded == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.generate(PARAMS, prompt_tokens=[1] * 65)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the prompt is 65 tokens (prompt_tokens); the model's context window is 64" in (
        err.value.details()
    )
    events = await cluster.generate(
        SamplingParams(temperature=0.0, max_tokens=4), prompt="x" * 20
    )  # one that fits runs
    assert sum(len(e.tokens) for e in events) == 4 and tokenizer.encoded == 20


@pytest.mark.asyncio
async def test_invalid_sampling_params_are_refused(cluster):
    request = pb.GenerateRequest(
        params=pb.SamplingParams(temperature=-1.0, top_p=1.0, max_tokens=4), prompt_tokens=PROMPT
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [e async for e in cluster.stub.Generate(request)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be a finite number >= 0, got -1.0" in err.value.details()


@pytest.mark.asyncio
async def test_results_from_an_unenrolled_verifier_are_never_emitted(key_set, tmp_path):
    c = await start(key_set, tmp_path, enrol_stranger=True)
    try:
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for event in c.stub.Generate(
                pb.GenerateRequest(params=convert.params_to_pb(PARAMS), prompt_tokens=PROMPT)
            ):
                received += list(event.tokens)
        assert received == []
        assert "not an enrolled verifier" in err.value.details()
    finally:
        await c.channel.close()
        await c.server.stop(None)
        await c.server.core.close()
        await c.verifier.stop()


# --- a proposer on another machine than the target's files ----------------------------------


@pytest.mark.asyncio
async def test_a_proposer_without_the_target_files_asks_the_verifier(key_set, tmp_path):
    c = await start(key_set, tmp_path, ask_identity=True)  # verifier.target: "no-target"
    try:
        assert c.server.core.target_identity == identity_of(c.verifier.backend)
        # its context window too: the HTTP API sizes a request without max_tokens by it
        assert c.server.core.target_context_length == c.verifier.backend.geometry.context_length
        events = await c.generate(PARAMS, prompt_tokens=[3, 1, 4, 1, 5])
        tokens = [t for e in events for t in e.tokens]
        assert len(tokens) == PARAMS.max_tokens
    finally:
        await stop(c)


class OtherTokenizerDraft(FakeBackend):
    def __init__(self):
        super().__init__(order=1, salt=1)
        i = self.identity
        self.identity = type(i)(i.model_digest, "other-tok", i.vocab_size, i.architecture, "")


@pytest.mark.asyncio
async def test_a_verifier_target_with_another_tokenizer_is_refused(key_set, tmp_path):
    verifier = Verifier(make_config(key_set, tmp_path / "wal"), key_set, FakeBackend)
    await verifier.start()
    cfg = verifier.config
    cfg = cfg.model_copy(
        update={
            "verifier": cfg.verifier.model_copy(update={"address": f"127.0.0.1:{verifier.port}"}),
            "proposer": cfg.proposer.model_copy(update={"address": "127.0.0.1:0"}),
        }
    )
    try:
        with pytest.raises(RefusedError, match="the pair must share one vocabulary"):
            await create_server(cfg, draft=OtherTokenizerDraft(), tokenizer=CharTokenizer())
    finally:
        await verifier.stop()


@pytest.mark.asyncio
async def test_an_unreachable_verifier_is_named_when_the_identity_is_needed(key_set, tmp_path):
    from muser_app.cli.config import free_port

    cfg = make_config(key_set, tmp_path / "wal")
    cfg = cfg.model_copy(
        update={
            "verifier": cfg.verifier.model_copy(update={"address": f"127.0.0.1:{free_port()}"}),
            "proposer": cfg.proposer.model_copy(
                update={"address": "127.0.0.1:0", "wal_dir": tmp_path / "p"}
            ),
        }
    )
    with pytest.raises(RefusedError, match="did not report its identity.*start the verifier"):
        await create_server(
            cfg, draft=FakeBackend(order=1, salt=1), tokenizer=CharTokenizer(), identity_timeout=1
        )


async def stop(c: Cluster) -> None:
    await c.channel.close()
    await c.server.stop(None)
    await c.server.core.close()
    await c.verifier.stop()


@pytest.mark.asyncio
async def test_lane_speculate_switches_latency_hiding_and_never_the_tokens(key_set, tmp_path):
    runs = {}
    for flag in (True, False):
        c = await start(key_set, tmp_path / str(flag), speculate=flag, lane={"lookahead": "on"})
        try:
            runner = await c.server.core.start_session(PROMPT, PARAMS)
            await runner.task
            runs[flag] = list(runner.session.emitted), runner.stats, c.verifier.manager.stats
        finally:
            await stop(c)
    (on, on_stats, on_verifier), (off, off_stats, off_verifier) = runs[True], runs[False]
    assert on == off and len(on) == PARAMS.max_tokens
    assert on_stats.speculated > 0 and off_stats.speculated == 0
    assert on_stats.speculated < on_stats.rounds
    # a wrong guess is replaced by a draft on the verifier's early decision: every next
    # draft was made ahead of its result
    assert on_stats.decisions_followed > 0 and off_stats.decisions_followed == 0
    assert on_stats.speculation_hits == on_stats.speculated
    # each draft made ahead was named to the verifier once the decision was known: it
    # evaluated the next round before its request (and the request took those rows)
    assert on_verifier.lookahead_hits > 0 and off_verifier.lookaheads == 0


@pytest.mark.asyncio
async def test_lane_lookahead_names_rounds_ahead_and_never_changes_the_tokens(key_set, tmp_path):
    runs = {}
    for setting in ("on", "off", "auto"):  # auto: the verifier is on loopback here, so off
        c = await start(key_set, tmp_path / setting, lane={"lookahead": setting})
        try:
            runner = await c.server.core.start_session(PROMPT, PARAMS)
            await runner.task
            runs[setting] = list(runner.session.emitted), c.verifier.manager.stats
        finally:
            await stop(c)
    assert runs["on"][0] == runs["off"][0] == runs["auto"][0]
    assert runs["on"][1].lookahead_hits > 0
    assert runs["off"][1].lookaheads == runs["auto"][1].lookaheads == 0


@pytest.mark.parametrize(
    ("setting", "address", "on"),
    [
        ("auto", "127.0.0.1:7000", False),
        ("auto", "127.8.0.3:7000", False),
        ("auto", "localhost:7000", False),
        ("auto", "[::1]:7000", False),
        ("auto", "10.0.0.7:7000", True),
        ("auto", "gx10.lan:7000", True),
        ("on", "127.0.0.1:7000", True),
        ("off", "10.0.0.7:7000", False),
    ],
)
def test_lookahead_auto_is_off_for_a_verifier_on_this_machine(setting, address, on):
    from proposer_mac.lane_setup import lookahead_on

    assert lookahead_on(setting, address) is on


@pytest.mark.asyncio
async def test_a_decision_the_result_contradicts_changes_no_token(cluster, monkeypatch):
    """The early decision is unsigned: a wrong one only wastes a draft, and a request sent
    ahead on it (lane.send_on_decision; when a lie names the guess the proposer drafted on)
    is void: the verifier refuses its head, nothing is written there, and the round is
    drafted and sent again (tests/proposer/test_send_ahead.py forces that path)."""
    from proposer_mac import journal
    from proposer_mac.link import RoundStream

    real, told = RoundStream.round_trip, []

    async def lying(self, signed, fragments, on_sent=None, on_decision=None, **kw):
        def lie(d):
            told.append(d.round)
            d = pb.Decision(
                round=d.round, accepted=d.accepted, next_frontier=(d.next_frontier + 1) % 24
            )
            on_decision(d)

        return await real(self, signed, fragments, on_sent, lie, **kw)

    monkeypatch.setattr(RoundStream, "round_trip", lying)
    core = cluster.server.core
    runner = await core.start_session(PROMPT, PARAMS)
    await runner.task
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS)
    assert runner.error is None and runner.session.emitted == local.tokens
    stats = runner.stats
    assert len(told) == stats.rounds and stats.decisions_followed > 0
    assert stats.speculation_hits < stats.speculated  # the drafts on lies were dropped
    assert stats.sent_ahead == stats.ahead_void  # every request sent on a lie was void
    assert cluster.verifier.manager.stats.rounds == stats.rounds  # none of them committed
    records = list(core.log.records())
    replayed = journal.replay(r.payload for r in records)[runner.session.session_id]
    assert len(replayed.committed) == stats.rounds and replayed.done
    assert replayed.prepared is None and replayed.ahead is None
    assert journal.WalInterpreter().check_chain(records, [], None) is None


@pytest.mark.asyncio
async def test_cancel_ends_the_session_after_the_round_in_flight(cluster):
    from proposer_mac import journal

    params = SamplingParams(temperature=1.0, max_tokens=300, seed=5)
    runner = await cluster.server.core.start_session(PROMPT, params)
    first, _ = await runner.wait_tokens(0)
    assert first
    runner.cancel()
    await runner.task
    emitted = runner.session.emitted
    assert runner.error is None and runner.finished
    assert 0 < len(emitted) < params.max_tokens
    assert await runner.wait_tokens(0) == (emitted, True)  # waiters see the end
    sid = runner.session.session_id
    journaled = journal.replay(r.payload for r in cluster.server.core.log.records())
    assert journaled[sid].done and journaled[sid].prepared is None
    for _ in range(200):
        if sid in cluster.verifier.manager.replay.closed:
            break
        await asyncio.sleep(0.01)
    assert sid in cluster.verifier.manager.replay.closed


@pytest.mark.asyncio
async def test_a_session_may_ask_for_a_draft_len_inside_the_lane_range_only(key_set, tmp_path):
    c = await start(
        key_set, tmp_path, lane={"draft_len": 3, "draft_len_min": 1, "draft_len_max": 3}
    )
    try:
        events = await c.generate(PARAMS, prompt_tokens=PROMPT, draft_len=2)
        runner = c.server.core.runners[events[0].session_id]
        assert runner.session.draft_len == 2 and runner.stats.drafted <= 2 * runner.stats.rounds
        for outside in (4, 9):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate(PARAMS, prompt_tokens=PROMPT, draft_len=outside)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"draft_len {outside} is outside the cluster's lane range [1, 3]" in (
                err.value.details()
            )
    finally:
        await stop(c)


@pytest.mark.asyncio
async def test_a_lane_at_d0_has_the_verifier_decode_and_emits_the_local_lane(key_set, tmp_path):
    from muser.width import FixedWidth

    local = run_local(
        FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS, width=FixedWidth(0, 1)
    )
    for decode_len, rounds in ((1, 40), (8, 5)):
        c = await start(
            key_set, tmp_path / str(decode_len), lane={"draft_len": 0, "decode_len": decode_len}
        )
        try:
            runner = await c.server.core.start_session(PROMPT, PARAMS)
            await runner.task
            assert runner.session.emitted == local.tokens
            assert runner.stats.rounds == rounds and runner.stats.drafted == 0
            assert runner.stats.width == {"mode": "fixed", "draft_len": 0, "decode_len": decode_len}
        finally:
            await stop(c)


@pytest.mark.asyncio
async def test_an_adaptive_lane_emits_the_local_lane_at_the_same_widths(key_set, tmp_path):
    from muser.records import RoundResult
    from muser.width import ScriptedWidth
    from proposer_mac import journal

    lane = {"draft_len": 4, "draft_len_min": 0, "draft_len_max": 6, "decode_len": 4}
    c = await start(key_set, tmp_path, lane=lane)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=120, seed=8)
        runner = await c.server.core.start_session(PROMPT, params)
        await runner.task
        sid = runner.session.session_id
        journaled = journal.replay(r.payload for r in c.server.core.log.records())
        results = [RoundResult.decode(s.body) for s in journaled[sid].committed]
    finally:
        await stop(c)
    widths = [len(r.drafts) for r in results]
    assert runner.stats.width["mode"] == "adaptive" and len(set(widths)) > 1, widths
    local = run_local(
        FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params, width=ScriptedWidth(widths, 4)
    )
    assert runner.session.emitted == local.tokens


@pytest.mark.asyncio
async def test_a_full_round_queue_is_waited_out_with_the_same_request(cluster, monkeypatch):
    from proposer_mac.link import RoundRefused, RoundStream

    real, refused = RoundStream.round_trip, []

    async def busy_twice(self, signed, fragments, *hooks, **kw):
        if len(refused) < 2:
            refused.append(signed)
            raise RoundRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, "round_queue_full", "full")
        return await real(self, signed, fragments, *hooks, **kw)

    monkeypatch.setattr(RoundStream, "round_trip", busy_twice)
    runner = await cluster.server.core.start_session(PROMPT, PARAMS)
    await runner.task
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS, q_top_k=32)
    assert runner.error is None and runner.session.emitted == local.tokens
    assert runner.stats.queue_full_retries == 2 and refused[0] == refused[1]  # the same bytes


@pytest.mark.asyncio
async def test_other_refusals_still_end_the_session(cluster, monkeypatch):
    from proposer_mac.link import RoundRefused, RoundStream

    async def refuse(self, signed, fragments, *hooks, **kw):
        raise RoundRefused(grpc.StatusCode.ABORTED, "head_mismatch", "head")

    monkeypatch.setattr(RoundStream, "round_trip", refuse)
    runner = await cluster.server.core.start_session(PROMPT, PARAMS)
    await runner.task
    assert isinstance(runner.error, RoundRefused) and runner.session.emitted == []


class ForkingDraft(FakeBackend):
    """A draft that forks a sequence of its own per session (as torch and mlx do)."""

    def __init__(self) -> None:
        super().__init__(order=1, salt=1)
        self.forks: list[FakeBackend] = []

    def fork(self) -> FakeBackend:
        self.forks.append(FakeBackend(order=1, salt=1))
        return self.forks[-1]


@pytest.mark.asyncio
async def test_each_session_drafts_on_its_own_kv_and_drops_it_at_the_end(key_set, tmp_path):
    draft = ForkingDraft()
    c = await start(key_set, tmp_path, draft=draft)
    try:
        runners = [await c.server.core.start_session(PROMPT, PARAMS) for _ in range(3)]
        await asyncio.gather(*(r.task for r in runners))
    finally:
        await stop(c)
    local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS, q_top_k=32)
    assert all(r.session.emitted == local.tokens for r in runners)
    assert len(draft.forks) == 3 and draft.evaluated == 0  # the shared KV never drafted
    assert all(f.evaluated > 0 and f.length == 0 for f in draft.forks)  # each dropped at its end
    # a finished runner (kept for limits.finished_sessions) holds no drafter, rows or KV
    assert all(r.drafter is None and r.ahead is None and r.send_ahead is None for r in runners)
    assert all(r.session.state._tempered is None for r in runners)  # nor draw caches


@pytest.mark.asyncio
async def test_old_finished_sessions_are_forgotten_but_still_counted(key_set, tmp_path):
    from proposer_mac.servicer import metrics_view

    c = await start(key_set, tmp_path, finished_sessions=2)
    try:
        runners = []
        for _ in range(4):
            runners.append(await c.server.core.start_session(PROMPT, PARAMS))
            await runners[-1].task
        held = c.server.core.runners
        assert list(held) == [r.session.session_id for r in runners[1:]]  # the oldest went
        lane = metrics_view(c.server.core).lane
        assert lane.rounds == sum(r.stats.rounds for r in runners)
        assert lane.emitted == 4 * PARAMS.max_tokens
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.generate(PARAMS, session_id=runners[0].session.session_id, offset=3)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "keeps the last limits.finished_sessions finished sessions" in err.value.details()
        rest = await c.generate(PARAMS, session_id=runners[3].session.session_id, offset=37)
        assert [t for e in rest for t in e.tokens] == runners[3].session.emitted[37:]
    finally:
        await stop(c)


@pytest.mark.asyncio
@pytest.mark.parametrize("ahead", [False, True], ids=["after-result", "on-decision"])
async def test_journal_order_and_acks_of_each_round(key_set, tmp_path, ahead):
    """After the result: COMMITTED of round r goes to the log in one write with PREPARED of
    round r+1 (with DONE after the last round), COMMITTED first. On the decision
    (lane.send_on_decision): PREPARED of round r+1 is durable, then that request is on the
    wire, both before COMMITTED of round r, which goes alone. Either way no ack goes before
    its round's COMMITTED is durable, and every round is acked, after the request that
    follows it."""
    from proposer_mac import journal
    from proposer_mac.link import RoundStream

    # a draft that is the target's twin: its guesses hold, so requests go ahead
    draft = FakeBackend() if ahead else None
    c = await start(
        key_set, tmp_path, lane={"lookahead": "on", "send_on_decision": ahead}, draft=draft
    )
    core = c.server.core
    events: list[tuple] = []
    writes: list[list[tuple]] = []
    append, append_many = core.log.append_async, core.log.append_many_async
    ack, round_trip, send = RoundStream.ack, RoundStream.round_trip, RoundStream.send

    def describe(payload):
        entry = journal.describe(payload)
        return entry["entry"], entry.get("round")

    async def recorded_append(payload):
        seq = await append(payload)
        writes.append([describe(payload)])
        events.append(describe(payload))
        return seq

    async def recorded_append_many(payloads):
        seqs = await append_many(payloads)
        writes.append([describe(p) for p in payloads])
        events.extend(describe(p) for p in payloads)
        return seqs

    async def recorded_ack(self, round_):
        events.append(("ack", round_))
        await ack(self, round_)

    async def recorded_round_trip(self, signed, *args, **kw):
        events.append(("sent", None))
        return await round_trip(self, signed, *args, **kw)

    async def recorded_send(self, signed):
        request = await send(self, signed)
        events.append(("wire", request.round))
        return request

    core.log.append_async, core.log.append_many_async = recorded_append, recorded_append_many
    RoundStream.ack, RoundStream.round_trip = recorded_ack, recorded_round_trip
    RoundStream.send = recorded_send
    try:
        runner = await core.start_session(PROMPT, PARAMS)
        await runner.task
    finally:
        RoundStream.ack, RoundStream.round_trip, RoundStream.send = ack, round_trip, send
        await stop(c)
    rounds = runner.stats.rounds
    assert runner.error is None and len(runner.session.emitted) == PARAMS.max_tokens
    session = [w for w in writes if w[0][0] != "open"]  # the session's own records

    def at(kind, r):
        return events.index((kind, r))

    went = [r for r in range(1, rounds) if at("prepared", r) < at("committed", r - 1)]
    assert len(went) == runner.stats.sent_ahead and (len(went) > 0 if ahead else not went)
    assert session == [
        [("prepared", 0)],
        *(
            w
            for r in range(rounds - 1)
            for w in (
                ([("prepared", r + 1)], [("committed", r)])
                if r + 1 in went
                else ([("committed", r), ("prepared", r + 1)],)
            )
        ),
        [("committed", rounds - 1), ("done", None)],
    ]
    for r in range(rounds):
        assert at("prepared", r) < at("wire", r)
        if r in went:
            assert at("wire", r) < at("committed", r - 1)
    assert [r for k, r in events if k == "ack"] == list(range(rounds))
    for r in range(rounds):
        assert at("committed", r) < at("ack", r)
        if r + 1 < rounds:
            assert at("ack", r) > [i for i, (k, _) in enumerate(events) if k == "sent"][r + 1]


@pytest.mark.asyncio
@pytest.mark.parametrize("ahead", [False, True], ids=["after-result", "on-decision"])
async def test_a_draft_that_fails_after_a_result_still_commits_that_result(
    key_set, tmp_path, monkeypatch, ahead
):
    """The round before a failed draft still becomes durable (no PREPARED follows: FAILED
    does), and its tokens reach clients before the session's error; the same when the draft
    was to go out on the round's decision."""
    from proposer_mac import journal
    from proposer_mac.ahead import DraftingAhead

    async def dead_draft(self, *args, **kw):
        raise RuntimeError("the draft backend died")

    monkeypatch.setattr(DraftingAhead, "take", dead_draft)  # the draft made ahead
    twin = FakeBackend()  # the target's twin: its guesses hold, so round 1 would go ahead
    c = await start(key_set, tmp_path, lane={"send_on_decision": ahead}, draft=twin)
    core = c.server.core
    try:
        runner = await core.start_session(PROMPT, PARAMS)
        await runner.task
        entries = [journal.describe(r.payload) for r in core.log.records()]
    finally:
        await stop(c)
    assert isinstance(runner.error, RuntimeError) and "draft backend died" in str(runner.error)
    emitted = runner.session.emitted
    assert len(emitted) > 0 and runner.durable == len(emitted)  # round 0's tokens
    mine = [(e["entry"], e.get("round")) for e in entries if e["entry"] != "open"]
    assert mine == [("prepared", 0), ("committed", 0), ("failed", None)]  # never resumed
    assert entries[-1]["reason"] == "the draft backend died"
    tokens, finished = await runner.wait_tokens(0)
    assert tokens == emitted and not finished


@pytest.mark.asyncio
async def test_a_request_that_does_not_parse_is_refused_as_invalid_not_unknown(key_set, tmp_path):
    """gRPC parses a request before any handler runs; the daemons' interceptor
    (`muser.channels.refuse_malformed`) answers one that does not parse with
    INVALID_ARGUMENT naming the method, and the daemon goes on serving."""
    c = await start(key_set, tmp_path)
    service = "/" + pb.DESCRIPTOR.services_by_name["Proposer"].full_name
    raw = {"request_serializer": None, "response_deserializer": None}
    try:
        for method, call in (
            ("Generate", c.channel.unary_stream(f"{service}/Generate", **raw)),
            ("Status", c.channel.unary_unary(f"{service}/Status", **raw)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                reply = call(b"\xff\xff\xff")  # a field tag with no end: corrupt wire format
                if method == "Generate":
                    [_ async for _ in reply]
                else:
                    await reply
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{service}/{method}: the message does not parse" in err.value.details()
        events = await c.generate(PARAMS, prompt_tokens=PROMPT)
        assert events[-1].done
    finally:
        await stop(c)


@pytest.mark.asyncio
async def test_a_stop_token_outside_the_vocabulary_is_refused_before_anything_is_journaled(
    key_set, tmp_path
):
    """Found by the fuzzer (test_generate_fuzz): the verifier refused it at open, after the
    proposer had journaled the session and its failure."""
    c = await start(key_set, tmp_path)
    try:
        seq = c.server.core.log.last_seq
        vocab = c.server.core.target_identity.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=4, stop_tokens=(vocab,))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.generate(params, prompt_tokens=PROMPT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"stop token {vocab} outside the vocabulary [0, {vocab})" in err.value.details()
        assert c.server.core.log.last_seq == seq and not c.server.core.runners
    finally:
        await stop(c)
