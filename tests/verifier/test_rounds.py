"""Whole sessions over a real grpc.aio verifier on loopback: tokens equal the local lane,
heads chain, retries are byte-identical, capture rows ride as fragments, status reports."""

from __future__ import annotations

import json

import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from muser import keys
from muser.capture import result_rows
from muser.records import RoundResult, SessionOpen, Signed, sha256
from muser.sampling import SamplingParams
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import PROMPT, CaptureBackend, Verifier, make_config
from verifier_gx.journal_check import VerifierJournal

pytestmark = pytest.mark.asyncio

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=40, seed=11)


def local_tokens(params: SamplingParams, draft_len: int, q_top_k: int) -> list[int]:
    result = run_local(
        FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, params,
        draft_len=draft_len, q_top_k=q_top_k,
    )  # fmt: skip
    return result.tokens


def check_chain(open_: SessionOpen, results: list[Signed], public) -> None:
    """Offline: every result verifies and chains genesis -> head by H(prev ‖ record)."""
    head = open_.genesis_head()
    for r, signed in enumerate(results):
        keys.verify(public, signed.body, signed.signature, f"round {r}")
        result = RoundResult.decode(signed.body)
        assert result.round == r
        assert result.prev_head == head
        assert result.head == sha256(head + result.record_bytes())
        head = result.head


@pytest.mark.parametrize(
    ("params", "draft_len", "q_top_k"),
    [(GREEDY, 3, 5), (SAMPLED, 3, 5), (SAMPLED, 0, 5), (SAMPLED, 6, 24)],
    ids=["greedy", "sampled", "sampled-empty-draft", "sampled-wide"],
)
async def test_session_equals_local_lane_and_heads_chain(verifier, params, draft_len, q_top_k):
    verifier.manager.rounds.max_drafts = max(4, draft_len)  # a lane of up to 6 (lane.draft_len_max)
    client = verifier.client(params, draft_len=draft_len, q_top_k=q_top_k)
    reply = await client.open_session()
    assert reply.head == reply.genesis_head == client.open.genesis_head()
    assert reply.next_round == 0
    stream = await client.attach()
    await client.run(stream)
    await stream.close()
    assert client.out == local_tokens(params, draft_len, q_top_k)
    assert len(client.out) == params.max_tokens
    check_chain(client.open, client.results, verifier.key_set.verifier.public_key())
    state = verifier.manager.replay.sessions[client.session_id]
    assert state.head == client.head and state.done
    assert state.next_round == len(client.results)
    report = VerifierJournal().verify(
        verifier.manager.log.records(),
        verifier_keys={verifier.manager.key_id: verifier.key_set.verifier.public_key()},
        proposer_keys={client.key_id: client.key.public_key()},
    )
    assert report.ok, report.first_bad
    assert report.sessions[0]["head"] == client.head.hex()
    assert report.sessions[0]["rounds"] == len(client.results)


async def test_retry_returns_the_stored_bytes_and_writes_nothing(verifier):
    client = verifier.client(SAMPLED)
    await client.open_session()
    stream = await client.attach()
    sent = []
    for _ in range(3):
        request = client.draft_request()
        sent.append(client.sign(request))
        msg, _ = await stream.round_trip(sent[-1])
        client.accept(request, msg)
        assert len(stream.decisions) == 1  # computed: its early decision came first
    seq, before = verifier.wal_seq, verifier.snapshot(client.session_id)
    for r in (2, 2, 0):  # the latest round twice, then the oldest one
        again, _ = await stream.round_trip(sent[r])
        assert again.WhichOneof("kind") == "result"
        assert stream.decisions == []  # answered from the log: nothing was decided again
        assert convert.result_from_pb(again.result).encode() == client.results[r].encode()
    assert verifier.wal_seq == seq
    assert verifier.snapshot(client.session_id) == before
    assert verifier.manager.stats.retries == 3
    await stream.close()


async def test_streams_interleave_sessions_on_the_shared_target(verifier):
    a, b = verifier.client(SAMPLED), verifier.client(GREEDY, draft_len=2)
    for c in (a, b):
        await c.open_session()
    sa, sb = await a.attach(), await b.attach()
    while not (a.done and b.done):
        for c, s in ((a, sa), (b, sb)):
            if not c.done:
                await c.step(s)
    assert a.out == local_tokens(SAMPLED, 3, 5)
    assert b.out == local_tokens(GREEDY, 2, 5)


async def test_duplicated_and_reordered_fragments_are_absorbed(verifier):
    client = verifier.client(SAMPLED)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=3)
    fragments = list(client.fragments().items())
    for digest, data in [*reversed(fragments), *fragments, fragments[0]]:
        await stream.fragment(digest, data)
    await client.run(stream)  # no error arrives in between: every fragment was absorbed
    assert client.out == local_tokens(SAMPLED, 3, 5)
    assert len(verifier.manager.fragments) == len(fragments)  # staged until the ack
    await stream.send(ack=pb.Ack(session_id=client.session_id, round=2))
    await stream.fragment(b"\0" * 32, b"")  # answered after the ack: a sync point
    assert (await stream.read()).error.reason == "fragment_hash_mismatch"
    assert len(verifier.manager.fragments) == len(fragments)  # staged for round 3
    await stream.send(ack=pb.Ack(session_id=client.session_id, round=3))
    await stream.fragment(b"\0" * 32, b"")
    await stream.read()
    assert len(verifier.manager.fragments) == 0
    await stream.close()


@pytest.mark.parametrize("decode_len", [None, 3], ids=["drafted", "decode rounds"])
async def test_capture_rows_arrive_as_fragments_named_by_the_result(key_set, tmp_path, decode_len):
    """Each layer's rows, float16, for every position committed since the session was last
    opened here, up to the next frontier (whose rows do not exist yet): from position 0 (the
    prompt) in the first round, from the round's frontier after that, from 0 again after a
    reopen (muser/capture.py). A draftless round decoding 3 tokens captures every step's
    position (the verifier offers `capture-decode`)."""
    v = await Verifier(make_config(key_set, tmp_path / "wal"), key_set, CaptureBackend).start()
    try:
        kw = {} if decode_len is None else {"draft_len": 0, "decode_len": decode_len}
        client = v.client(SAMPLED, capture_layers=(1, 0), **kw)
        await client.open_session()
        stream = await client.attach()
        for i in range(4):
            if i == 3:  # the proposer comes back: its draft may have lost every row
                await stream.close()
                await client.open_session()
                stream = await client.attach()
            request = client.draft_request()
            first = 0 if i in (0, 3) else len(client.transcript) - 1
            msg, fragments = await stream.round_trip(client.sign(request))
            result = client.accept(request, msg)
            if decode_len is not None:
                assert request.decode_len == 3 and len(result.emitted()) == 3
            end = len(client.transcript) - 1  # the next frontier's position
            assert [f.digest for f in fragments] == list(result.capture_digests)
            assert len(fragments) == 2
            rows = result_rows(result.capture_digests, {f.digest: f.data for f in fragments},
                               client.session_id, result.round, (0, 1), end)  # fmt: skip
            assert rows[0] == first
            for layer in (0, 1):
                expected = [[layer, p, client.transcript[p]] for p in range(first, end)]
                np.testing.assert_array_equal(rows[1][layer], np.array(expected, np.float32))
        await stream.close()
    finally:
        await v.stop()


async def test_status_and_health(verifier):
    client = verifier.client(GREEDY)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream)
    await stream.close()
    status = await verifier.stub.Status(pb.StatusRequest())
    data = json.loads(status.json)
    assert status.role == "verifier" and status.key_id == verifier.manager.key_id
    assert data["sessions"] == status.sessions == 1
    assert data["emitted"] == GREEDY.max_tokens
    assert data["rounds"] == len(client.results)
    assert data["verify_s"] > 0
    assert data["verifier_ceiling_tok_s"] == pytest.approx(data["emitted"] / data["verify_s"])
    assert data["wal"]["last_seq"] == verifier.wal_seq and data["wal"]["bytes"] > 0
    assert data["wal"]["fsync_mean_s"] > 0
    health = health_pb2_grpc.HealthStub(verifier.channel)
    for service in ("", "muser.v2.Verifier"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


class _CountingKey:
    """The verifier's signing key, counting its signatures."""

    def __init__(self, key) -> None:
        self.key, self.signed = key, 0

    def sign(self, body: bytes) -> bytes:
        self.signed += 1
        return self.key.sign(body)


def as_message(outcome) -> pb.VerifierMessage:
    """A `SessionManager.run_round` outcome as the stream carries it."""
    signed = Signed.decode(outcome.signed)
    result = convert.result_to_pb(Signed(signed.body, signed.signature, outcome.result))
    return pb.VerifierMessage(result=result)


async def test_the_decision_is_told_before_the_result_is_signed_or_committed(verifier, caplog):
    client = verifier.client(GREEDY)
    await client.open_session()
    counting = _CountingKey(verifier.manager.rounds.computer.signing_key)
    verifier.manager.rounds.computer.signing_key = counting
    seen = []

    def decided(d, capture_digests) -> None:  # in the worker thread
        seen.append((d.accepted, capture_digests, counting.signed, verifier.wal_seq))

    request = client.draft_request()
    seq = verifier.wal_seq
    outcome = await verifier.manager.run_round(convert.request_from_pb(client.sign(request)),
                                               decided)  # fmt: skip
    assert seen == [(outcome.result.accepted, (), 0, seq)]  # nothing signed, nothing written yet
    assert counting.signed == 1 and verifier.wal_seq == seq + 1

    def broken(d, capture_digests) -> None:
        raise RuntimeError("injected: the stream is gone")

    client.accept(request, as_message(outcome))
    request = client.draft_request()
    with caplog.at_level("WARNING", logger="muser.verifier"):
        outcome = await verifier.manager.run_round(
            convert.request_from_pb(client.sign(request)), broken
        )
    assert outcome.result.round == 1 and verifier.wal_seq == seq + 2  # committed all the same
    assert "the early decision of a round was not sent: injected" in caplog.text
