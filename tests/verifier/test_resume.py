"""Resume: a session goes on at a verifier that does not hold its last committed round (a
node that never saw it, a lost commit log, a verifier left behind), from the proposer's
signed round, its transcript and MT state; every bad resume is refused and writes nothing."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
import pytest_asyncio

from muser import keys
from muser.errors import JournalError
from muser.mt19937 import Mt19937
from muser.records import RoundResult, Signed, sha256, state_digest, tokens_bytes
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config
from tests.verifier.test_open import refused
from verifier_gx import journal, journal_check
from verifier_gx.journal_check import VerifierJournal
from verifier_gx.replay import Replay
from wal.log import FileLog

pytestmark = pytest.mark.asyncio

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=9)
C = grpc.StatusCode
SID = bytes(range(16))


def node(key_set, wal_dir, other, *, own: str = "verifier"):
    """A verifier config enrolling both verifier keys, signing with `own`'s."""
    private, stem = other
    cfg = make_config(key_set, wal_dir)
    enrolment = cfg.enrolment.model_copy(
        update={"verifiers": [key_set.dir / "verifier.pub", stem.with_suffix(".pub")]}
    )
    verifier = cfg.verifier
    if own == "other":
        verifier = verifier.model_copy(
            update={"key": stem.with_suffix(".key"), "public_key": stem.with_suffix(".pub")}
        )
    return cfg.model_copy(update={"enrolment": enrolment, "verifier": verifier})


async def start(key_set, config) -> Verifier:
    return await Verifier(config, key_set, FakeBackend).start()


async def reference(key_set, tmp_path, params=PARAMS):
    v = await start(key_set, make_config(key_set, tmp_path / "ref"))
    try:
        client = v.client(params, session_id=SID)
        await client.open_session()
        await client.run(await client.attach())
        return client.out, client.head
    finally:
        await v.stop()


def move(client, to: Verifier, public) -> None:
    """The proposer points at another verifier (and accepts its key's results)."""
    client.stub = to.stub
    client.verifier_public = public


async def test_another_verifier_resumes_and_goes_on_as_the_first_would(key_set, tmp_path, other):
    out, head = await reference(key_set, tmp_path)
    a = await start(key_set, node(key_set, tmp_path / "a", other))
    b_config = node(key_set, tmp_path / "b", other, own="other")
    b = await start(key_set, b_config)
    try:
        client = a.client(PARAMS, session_id=SID)
        await client.open_session()
        await client.run(await client.attach(), rounds=3)
        at = (client.next_round, client.head)
        move(client, b, other[0].public_key())
        reply = await client.resume_session()
        assert reply.resumed and (reply.next_round, reply.head) == at
        assert b.manager.stats.resumes == 1 and a.manager.stats.resumes == 0
        status = json.loads((await b.stub.Status(pb.StatusRequest())).json)
        assert status["resumes"] == 1
        assert b.snapshot(client.session_id)[5] == state_digest(client.mt)
        await client.run(await client.attach())
        assert client.out == out and client.head == head  # heads bind no key: same chain
        signers = {RoundResult.decode(s.body).verifier_key_id for s in client.results[3:]}
        assert signers == {keys.key_id(other[0].public_key())}
        # the same resume again: B holds that round now; a plain re-open, nothing written
        seq = b.wal_seq
        client.results = client.results[:3]
        assert not (await client.resume_session()).resumed
        assert b.wal_seq == seq
        committed = b.snapshot(client.session_id)
    finally:
        await a.stop()
        await b.stop()
    # B restarts on its log: RESUME replays to the same session
    b = await start(key_set, b_config)
    try:
        assert b.snapshot(client.session_id) == committed
    finally:
        await b.stop()
    with FileLog(b_config.verifier.wal_dir / "commit") as log:
        records = list(log.records(1))
    kinds = [type(journal.decode(r.payload)).__name__ for r in records]
    assert kinds[0] == "ResumeEntry" and set(kinds[1:]) == {"RoundEntry"}
    pairs = [(r.seq, r.payload) for r in records]
    both = {keys.key_id(k): k for k in (key_set.verifier.public_key(), other[0].public_key())}
    assert VerifierJournal().verify(pairs, verifier_keys=both).ok
    only_b = {keys.key_id(other[0].public_key()): other[0].public_key()}
    report = VerifierJournal().verify(pairs, verifier_keys=only_b)
    assert report.first_bad.seq == records[0].seq
    assert keys.key_id(key_set.verifier.public_key()) in report.first_bad.reason


async def test_a_verifier_that_holds_the_round_reopens_without_resuming(key_set, tmp_path, other):
    a = await start(key_set, node(key_set, tmp_path / "a", other))
    try:
        client = a.client(PARAMS)
        await client.open_session()
        await client.run(await client.attach(), rounds=3)
        before = a.snapshot(client.session_id)
        reply = await client.resume_session()
        assert not reply.resumed and reply.next_round == 3
        assert a.snapshot(client.session_id) == before  # nothing written, nothing moved
    finally:
        await a.stop()


async def left_behind(a, b, other, key_set):
    """A session two rounds on A, then three on B, pointed back at A (three rounds behind)."""
    client = a.client(PARAMS, session_id=SID)
    await client.open_session()
    await client.run(await client.attach(), rounds=2)
    move(client, b, other[0].public_key())
    await client.resume_session()
    await client.run(await client.attach(), rounds=3)
    move(client, a, key_set.verifier.public_key())
    assert a.manager.replay.sessions[client.session_id].next_round == 2
    return client


async def test_a_verifier_left_behind_moves_to_the_resume_point(key_set, tmp_path, other):
    out, head = await reference(key_set, tmp_path)
    a_config = node(key_set, tmp_path / "a", other)
    a = await start(key_set, a_config)
    b = await start(key_set, node(key_set, tmp_path / "b", other, own="other"))
    try:
        client = await left_behind(a, b, other, key_set)
        reply = await client.resume_session()
        assert reply.resumed and reply.next_round == 5 and reply.head == client.head
        await client.run(await client.attach())
        assert client.out == out and client.head == head
    finally:
        await a.stop()
        await b.stop()
    with FileLog(a_config.verifier.wal_dir / "commit") as log:
        records = [(r.seq, r.payload) for r in log.records(1)]
    both = {keys.key_id(k): k for k in (key_set.verifier.public_key(), other[0].public_key())}
    assert VerifierJournal().verify(records, verifier_keys=both).ok


@pytest_asyncio.fixture
async def moved(key_set, tmp_path, other):
    """A session three rounds in on A, and B (empty) that it is about to move to."""
    a = await start(key_set, node(key_set, tmp_path / "a", other))
    b = await start(key_set, node(key_set, tmp_path / "b", other, own="other"))
    client = a.client(PARAMS)
    await client.open_session()
    await client.run(await client.attach(), rounds=3)
    move(client, b, other[0].public_key())
    yield a, b, client
    await a.stop()
    await b.stop()


async def refused_at(b, call, code, reason) -> str:
    """Refused, nothing written, and the session still unknown to B."""
    details = await refused(b, call, code, reason)
    assert not b.manager.replay.sessions
    return details


async def test_a_resume_signed_by_a_key_that_is_not_enrolled_is_refused(moved, key_set):
    _, b, client = moved
    point = RoundResult.decode(client.results[-1].body)
    stranger = keys.key_id(key_set.stranger.public_key())
    forged = dataclasses.replace(point, verifier_key_id=stranger).encode()
    resume = Signed(forged, key_set.stranger.sign(forged)).encode()
    details = await refused_at(
        b, client.resume_session(resume=resume), C.PERMISSION_DENIED, "unenrolled_key"
    )
    assert stranger in details


async def test_a_resume_altered_in_any_signed_field_is_refused(moved):
    _, b, client = moved
    signed = client.results[-1]
    point = RoundResult.decode(signed.body)
    for change in (
        {"accepted": point.accepted ^ 1},
        {"next_frontier": point.next_frontier + 1},
        {"head": bytes(32)},
        {"round": point.round + 1},
    ):
        altered = Signed(dataclasses.replace(point, **change).encode(), signed.signature)
        await refused_at(
            b, client.resume_session(resume=altered.encode()), C.UNAUTHENTICATED, "bad_signature"
        )


async def test_an_open_signature_that_does_not_cover_the_resume_is_refused(moved):
    _, b, client = moved
    await refused_at(
        b, client.resume_session(signed_resume=b""), C.UNAUTHENTICATED, "bad_signature"
    )
    earlier = client.results[-2].encode()
    await refused_at(
        b, client.resume_session(signed_resume=earlier), C.UNAUTHENTICATED, "bad_signature"
    )


async def test_a_transcript_or_state_that_the_round_did_not_commit_is_refused(moved):
    _, b, client = moved
    resume, chunks, fragments = client.resume_point()
    point = RoundResult.decode(client.results[-1].body)
    dropped = (chunks[0], point.post_state_digest)  # (before B was sent either)
    held = {d: data for d, data in fragments.items() if d not in dropped}
    details = await refused_at(
        b, client.resume_session(fragments=held), C.FAILED_PRECONDITION, "missing_fragments"
    )
    assert all(d.hex()[:16] in details for d in dropped)  # every one named at once
    wrong = list(client.transcript)
    wrong[-2] = (wrong[-2] + 1) % 24
    chunk = tokens_bytes(wrong)
    details = await refused_at(
        b,
        client.resume_session(
            resume_transcript=(sha256(chunk),), fragments={**fragments, sha256(chunk): chunk}
        ),
        C.FAILED_PRECONDITION,
        "fragment_mismatch",
    )
    assert point.transcript_digest.hex() in details
    other_prompt = tokens_bytes([3, 3, 3, *client.transcript[3:]])
    await refused_at(
        b,
        client.resume_session(
            resume_transcript=(sha256(other_prompt),),
            fragments={**fragments, sha256(other_prompt): other_prompt},
        ),
        C.FAILED_PRECONDITION,
        "fragment_mismatch",
    )


async def test_a_resume_point_of_another_session_or_a_later_epoch_is_refused(moved, key_set):
    a, b, client = moved
    second = a.client(PARAMS)
    await second.open_session()
    await second.run(await second.attach(), rounds=1)
    theirs = second.results[-1].encode()
    details = await refused_at(
        b, client.resume_session(resume=theirs), C.INVALID_ARGUMENT, "resume_mismatch"
    )
    assert second.session_id.hex() in details
    # a round committed at epoch 2, carried by an open at epoch 1
    second.epoch = 2
    await second.open_session()
    await second.run(await second.attach(), rounds=1)
    second.stub = b.stub
    second.epoch = 1
    details = await refused_at(b, second.resume_session(), C.INVALID_ARGUMENT, "resume_mismatch")
    assert "epoch 2" in details
    await refused_at(b, client.resume_session(resume=b"junk"), C.INVALID_ARGUMENT, "malformed")


async def test_a_finished_session_is_not_resumed(moved):
    a, b, client = moved
    client.stub = a.stub
    client.verifier_public = a.manager.signing_key.public_key()
    await client.run(await client.attach())
    assert client.done
    client.stub = b.stub
    await refused_at(b, client.resume_session(), C.FAILED_PRECONDITION, "session_finished")


async def test_a_stale_epoch_resume_is_refused_where_the_session_is_held(moved):
    a, _, client = moved
    client.stub = a.stub
    client.epoch = 3
    await client.open_session()  # fenced at epoch 3
    client.epoch = 2
    before = a.snapshot(client.session_id)
    await refused(a, client.resume_session(), C.ABORTED, "stale_epoch")
    assert a.snapshot(client.session_id) == before


async def test_a_tampered_resume_entry_does_not_replay(moved, other, key_set):
    _, b, client = moved
    await client.resume_session()
    payload = next(iter(b.manager.log.records(1))).payload
    entry = journal.decode(payload)
    both = {keys.key_id(k): k for k in (key_set.verifier.public_key(), other[0].public_key())}
    assert Replay(verifier_keys=both).apply(entry).next_round == 3
    mt = Mt19937.from_bytes(entry.mt)
    mt.uniform_f64()
    generated = (*entry.generated[:-1], (entry.generated[-1] + 1) % 24)
    for bad, words in (
        (dataclasses.replace(entry, mt=mt.to_bytes()), "MT19937 state"),
        (dataclasses.replace(entry, generated=generated), "transcript"),
        (dataclasses.replace(entry, epoch=0), "epoch"),
    ):
        with pytest.raises(JournalError, match=words):
            Replay(verifier_keys=both).apply(journal.decode(journal.encode(bad)))
    proposers = {client.key_id: key_set.proposer.public_key()}
    replay = Replay(verifier_keys=both, proposer_keys=proposers)
    assert replay.apply(entry).head == client.head
    forged = dataclasses.replace(entry, signature=key_set.stranger.sign(b"x"))
    with pytest.raises(JournalError, match="signature"):
        Replay(verifier_keys=both, proposer_keys=proposers).apply(forged)
    described = journal_check.describe(payload)
    assert described["entry"] == "resume" and described["after_round"] == 2
