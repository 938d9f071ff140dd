"""OpenSession / CloseSession: identities checked at the handshake, idempotent re-open,
epoch fencing, limits; every refusal names what was received and expected, writes nothing."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from muser.records import close_message, sha256, tokens_bytes
from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from tests.verifier.conftest import CaptureBackend, Verifier, make_config

pytestmark = pytest.mark.asyncio

PARAMS = SamplingParams(temperature=1.0, max_tokens=20, seed=2)
C = grpc.StatusCode


async def refused(verifier, call, code: grpc.StatusCode, reason: str) -> str:
    seq = verifier.wal_seq
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    err = caught.value
    assert err.code() == code, err.details()
    assert dict(err.trailing_metadata())["muser-reason"] == reason
    assert verifier.wal_seq == seq
    return err.details()


IDENTITY_CASES = {
    "target_model": ("target", "model_digest", "fake-9-9"),
    "target_tokenizer": ("target", "tokenizer_digest", "other-tok"),
    "target_vocab": ("target", "vocab_size", 25),
    "draft_tokenizer": ("draft", "tokenizer_digest", "other-tok"),
}


@pytest.mark.parametrize("case", sorted(IDENTITY_CASES))
async def test_open_refuses_identity_mismatch_naming_both_values(verifier, case):
    side, name, bad = IDENTITY_CASES[case]
    client = verifier.client(PARAMS)
    ident = getattr(client.open, side)
    real = getattr(verifier.backend.identity, name)
    wrong = dataclasses.replace(client.open, **{side: dataclasses.replace(ident, **{name: bad})})
    details = await refused(
        verifier, client.open_session(open_=wrong), C.FAILED_PRECONDITION, "identity_mismatch"
    )
    assert repr(bad) in details and repr(real) in details


async def test_a_draft_with_a_padded_embedding_opens(verifier):
    """The draft shares the target's vocabulary (its digest) but pads its embedding past
    it, or holds fewer rows than the target's padded one: embedding sizes may differ."""
    for rows in (23, 64):
        client = verifier.client(PARAMS)
        padded = dataclasses.replace(
            client.open, draft=dataclasses.replace(client.open.draft, vocab_size=rows)
        )
        await client.open_session(open_=padded)


async def test_open_refusals(verifier, key_set):
    client = verifier.client(PARAMS)
    o = client.open
    await refused(
        verifier, client.open_session(signer=key_set.stranger), C.UNAUTHENTICATED, "bad_signature"
    )
    stranger = dataclasses.replace(o, proposer_key_id="f" * 16)
    details = await refused(
        verifier,
        client.open_session(open_=stranger, signer=key_set.stranger),
        C.PERMISSION_DENIED,
        "unenrolled_key",
    )
    assert "f" * 16 in details
    too_long = dataclasses.replace(o, params=dataclasses.replace(PARAMS, max_tokens=5000))
    details = await refused(
        verifier, client.open_session(open_=too_long), C.INVALID_ARGUMENT, "invalid_params"
    )
    assert "5000" in details and "4096" in details
    bad_params = client.open_pb()
    bad_params.params.top_p = 0.0
    await refused(
        verifier, verifier.stub.OpenSession(bad_params), C.INVALID_ARGUMENT, "invalid_params"
    )
    bad_genesis = client.open_pb()
    bad_genesis.genesis_head = bytes(32)
    await refused(
        verifier, verifier.stub.OpenSession(bad_genesis), C.INVALID_ARGUMENT, "genesis_mismatch"
    )
    stop = dataclasses.replace(o, params=dataclasses.replace(PARAMS, stop_tokens=(24,)))
    await refused(
        verifier, client.open_session(open_=stop), C.INVALID_ARGUMENT, "token_out_of_vocabulary"
    )


async def test_open_prompt_fragment(verifier):
    client = verifier.client(PARAMS)
    digest = client.open.prompt_digest
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.open_session(fragments={})
    assert caught.value.code() == C.FAILED_PRECONDITION
    meta = dict(caught.value.trailing_metadata())
    assert meta["muser-reason"] == "missing_fragments" and meta["muser-missing"] == digest.hex()
    await refused(
        verifier,
        client.open_session(fragments={digest: tokens_bytes([1, 2, 3])}),
        C.DATA_LOSS,
        "fragment_hash_mismatch",
    )
    outside = [1, 99]
    o = dataclasses.replace(client.open, prompt_digest=sha256(tokens_bytes(outside)))
    await refused(
        verifier,
        client.open_session(open_=o, fragments={o.prompt_digest: tokens_bytes(outside)}),
        C.INVALID_ARGUMENT,
        "token_out_of_vocabulary",
    )
    ragged = b"\x01\x00\x00"
    o = dataclasses.replace(client.open, prompt_digest=sha256(ragged))
    await refused(
        verifier,
        client.open_session(open_=o, fragments={o.prompt_digest: ragged}),
        C.INVALID_ARGUMENT,
        "invalid_prompt",
    )


async def test_reopen_is_idempotent_and_epochs_fence(verifier):
    client = verifier.client(PARAMS, epoch=2)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=2)
    seq = verifier.wal_seq
    again = await client.open_session(fragments={})  # the verifier holds the prompt
    assert (again.head, again.next_round, again.epoch) == (client.head, 2, 2)
    assert verifier.wal_seq == seq
    await refused(verifier, client.open_session(epoch=1), C.ABORTED, "stale_epoch")
    fewer = dataclasses.replace(client.open.params, max_tokens=PARAMS.max_tokens - 1)
    different = dataclasses.replace(client.open, params=fewer)
    await refused(
        verifier, client.open_session(open_=different), C.ALREADY_EXISTS, "session_conflict"
    )
    # a takeover at epoch 3: one EPOCH entry, and the epoch-2 stream is fenced off
    taken = await client.open_session(epoch=3)
    assert (taken.epoch, taken.next_round, taken.head) == (3, 2, client.head)
    assert verifier.wal_seq == seq + 1
    request = client.draft_request()
    msg, _ = await stream.round_trip(client.sign(request))
    assert (msg.error.code, msg.error.reason) == (C.ABORTED.value[0], "stale_epoch")
    assert "3" in msg.error.message
    client.epoch = 3
    stream3 = await client.attach()
    await client.run(stream3)
    twin = verifier.client(PARAMS)
    await twin.open_session()
    await twin.run(await twin.attach())
    assert client.out == twin.out
    stale = client.stub.Rounds()
    await stale.write(pb.ProposerMessage(attach=pb.Attach(session_id=client.session_id, epoch=2)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stale.read()
    assert caught.value.code() == C.ABORTED


async def test_max_sessions(key_set, tmp_path):
    from tests.core.fake_backend import FakeBackend

    v = await Verifier(
        make_config(key_set, tmp_path / "wal", max_sessions=2), key_set, FakeBackend
    ).start()
    try:
        a, b, c = (v.client(PARAMS) for _ in range(3))
        await a.open_session()
        await b.open_session()
        details = await refused(v, c.open_session(), C.RESOURCE_EXHAUSTED, "max_sessions")
        assert "2" in details
        await a.open_session()  # re-opening an open session is not a new one
        await v.stub.CloseSession(
            pb.CloseSessionRequest(
                session_id=a.session_id,
                epoch=1,
                signature=a.key.sign(close_message(a.session_id, 1)),
            )
        )
        await c.open_session()
        await refused(v, v.client(PARAMS).open_session(), C.RESOURCE_EXHAUSTED, "max_sessions")
        await b.run(await b.attach())  # a finished session no longer takes a slot
        await v.client(PARAMS).open_session()
    finally:
        await v.stop()


async def test_close(verifier, key_set):
    client = verifier.client(PARAMS)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=1)
    sid = client.session_id

    def close(key, epoch=1):
        return verifier.stub.CloseSession(
            pb.CloseSessionRequest(
                session_id=sid, epoch=epoch, signature=key.sign(close_message(sid, epoch))
            )
        )

    await refused(verifier, close(key_set.stranger), C.UNAUTHENTICATED, "bad_signature")
    await refused(verifier, close(client.key, 0), C.ABORTED, "stale_epoch")
    seq = verifier.wal_seq
    # a higher epoch closes it too: its proposer moved it to another verifier of its pool,
    # where it ended, and closes it here for good
    await close(client.key, 2)
    assert verifier.wal_seq == seq + 1
    await close(client.key)  # closing twice is a no-op
    assert verifier.wal_seq == seq + 1
    msg, _ = await stream.round_trip(client.sign(client.draft_request()))
    assert (msg.error.code, msg.error.reason) == (
        C.FAILED_PRECONDITION.value[0],
        "session_closed",
    )
    await refused(verifier, client.open_session(), C.FAILED_PRECONDITION, "session_closed")
    unknown = verifier.client(PARAMS)
    await refused(
        verifier,
        verifier.stub.CloseSession(pb.CloseSessionRequest(session_id=unknown.session_id)),
        C.NOT_FOUND,
        "unknown_session",
    )


async def test_capture_layer_outside_the_target(key_set, tmp_path):
    v = await Verifier(make_config(key_set, tmp_path / "wal"), key_set, CaptureBackend).start()
    try:
        client = v.client(PARAMS, capture_layers=(2,))
        details = await refused(v, client.open_session(), C.INVALID_ARGUMENT, "capture_layer")
        assert "[0, 2)" in details
    finally:
        await v.stop()


async def test_capture_layers_on_a_backend_that_cannot_capture_are_refused(verifier):
    # the fixture verifier's FakeBackend has no evaluate_capture (like the vLLM backend)
    client = verifier.client(PARAMS, capture_layers=(0,))
    details = await refused(verifier, client.open_session(), C.INVALID_ARGUMENT, "capture_layer")
    assert "cannot capture hidden rows" in details
    assert not verifier.manager.replay.sessions  # nothing opened, nothing journaled


async def test_session_longer_than_the_context_window_is_refused(verifier):
    longest = SamplingParams(temperature=1.0, max_tokens=4096, seed=2)  # 4 + 4096 - 1 > 4096
    client = verifier.client(longest)
    details = await refused(verifier, client.open_session(), C.OUT_OF_RANGE, "context_overflow")
    assert "4099" in details and "4096" in details
    fits = verifier.client(dataclasses.replace(longest, max_tokens=4093))
    await fits.open_session()
