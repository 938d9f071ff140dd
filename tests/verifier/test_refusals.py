"""Every bad round input is refused with its status code, reason and a message; nothing is
written to the WAL and the session state is unchanged (docs/design.md §6, §7)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import grpc
import numpy as np
import pytest

from muser.records import RoundRequest, RoundResult, sha256
from muser.sampling import SamplingParams, SparseRow
from muser.wire import muser_v2_pb2 as pb
from tests.core.fake_backend import FakeBackend
from tests.verifier.conftest import Verifier, make_config

pytestmark = pytest.mark.asyncio

SAMPLED = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
C = grpc.StatusCode


def with_row(request: RoundRequest, i: int, row: SparseRow) -> RoundRequest:
    rows = list(request.q_rows)
    rows[i] = row
    return dataclasses.replace(request, q_rows=tuple(rows))


def set_weight(request: RoundRequest, token_of_row: int, value: float) -> RoundRequest:
    row = request.q_rows[0]
    weights = row.weights.copy()
    weights[token_of_row] = value
    return with_row(request, 0, SparseRow(row.ids.copy(), weights))


def drafted_position(request: RoundRequest) -> int:
    return int(np.searchsorted(request.q_rows[0].ids, request.drafts[0]))


def other_token(request: RoundRequest) -> RoundRequest:
    """A draft the replayed draw does not select, though its row gives it q > 0."""
    row = request.q_rows[0]
    other = next(int(t) for t in row.ids if int(t) != request.drafts[0])
    return dataclasses.replace(request, drafts=(other, *request.drafts[1:]))


MUTATIONS = {
    "row_count": (lambda r: dataclasses.replace(r, q_rows=r.q_rows[:-1]),
                  C.INVALID_ARGUMENT, "row_count"),
    "draft_outside_vocab": (lambda r: dataclasses.replace(r, drafts=(24, *r.drafts[1:])),
                            C.INVALID_ARGUMENT, "token_out_of_vocabulary"),
    "row_id_outside_vocab": (
        lambda r: with_row(r, 0, SparseRow(np.append(r.q_rows[0].ids, 99),
                                           np.append(r.q_rows[0].weights, 0.1))),
        C.INVALID_ARGUMENT, "token_out_of_vocabulary"),
    "nan_q_weight": (lambda r: set_weight(r, -1, float("nan")),
                     C.INVALID_ARGUMENT, "invalid_weights"),
    "negative_q_weight": (lambda r: set_weight(r, -1, -0.25),
                          C.INVALID_ARGUMENT, "invalid_weights"),
    "q_zero_for_draft": (lambda r: set_weight(r, drafted_position(r), 0.0),
                         C.INVALID_ARGUMENT, "draft_zero_probability"),
    "draft_not_selected_by_draws": (other_token, C.FAILED_PRECONDITION, "draft_mismatch"),
    "too_many_drafts": (lambda r: dataclasses.replace(r, drafts=r.drafts * 20,
                                                      q_rows=r.q_rows * 20),
                        C.INVALID_ARGUMENT, "too_many_drafts"),
    "stale_epoch": (lambda r: dataclasses.replace(r, epoch=r.epoch - 1),
                    C.ABORTED, "stale_epoch"),
    "future_epoch": (lambda r: dataclasses.replace(r, epoch=r.epoch + 1),
                     C.FAILED_PRECONDITION, "future_epoch"),
    "head_mismatch": (lambda r: dataclasses.replace(r, expected_head=os.urandom(32)),
                      C.ABORTED, "head_mismatch"),
    "round_ahead": (lambda r: dataclasses.replace(r, round=r.round + 1),
                    C.FAILED_PRECONDITION, "round_out_of_order"),
    "frontier_mismatch": (lambda r: dataclasses.replace(r, frontier=(r.frontier + 1) % 24),
                          C.FAILED_PRECONDITION, "frontier_mismatch"),
    "transcript_chunk_count": (lambda r: dataclasses.replace(
                                   r, transcript_digests=r.transcript_digests * 2),
                               C.FAILED_PRECONDITION, "fragment_mismatch"),
    "decode_len_zero": (lambda r: dataclasses.replace(r, decode_len=0),
                        C.INVALID_ARGUMENT, "decode_len"),
    "decode_len_with_drafts": (lambda r: dataclasses.replace(r, decode_len=2),
                               C.INVALID_ARGUMENT, "decode_len"),
    "decode_len_over_the_lane": (lambda r: undrafted(r, 9), C.INVALID_ARGUMENT, "decode_len"),
    "lookup_with_drafts": (lambda r: dataclasses.replace(r, lookup=(2, 3)),
                           C.INVALID_ARGUMENT, "lookup_rule"),
    "lookup_n_zero": (lambda r: dataclasses.replace(undrafted(r, 4), lookup=(0, 3)),
                      C.INVALID_ARGUMENT, "lookup_rule"),
    "lookup_min_over_max": (lambda r: dataclasses.replace(undrafted(r, 4), lookup=(3, 2)),
                            C.INVALID_ARGUMENT, "lookup_rule"),
    "lookup_n_past_the_bound": (lambda r: dataclasses.replace(undrafted(r, 4), lookup=(2, 17)),
                                C.INVALID_ARGUMENT, "lookup_rule"),
    "more_drafts_than_the_lane": (lambda r: dataclasses.replace(r, drafts=r.drafts * 2,
                                                                q_rows=r.q_rows * 2),
                                  C.INVALID_ARGUMENT, "too_many_drafts"),
    "q_weights_summing_to_infinity": (
        lambda r: with_row(r, 0, SparseRow(r.q_rows[0].ids.copy(),
                                           np.full(r.q_rows[0].ids.size, 1e308))),
        C.INVALID_ARGUMENT, "invalid_weights"),
    "transcript_digest_not_32_bytes": (lambda r: dataclasses.replace(
                                           r, transcript_digests=(b"abc",)),
                                       C.INVALID_ARGUMENT, "malformed"),
}  # fmt: skip
"""The last three were holes found in review: a round of 6 drafts to a lane of at most 4
was computed and signed (only the session's remaining tokens bounded D, so a round's
witness rows could be 4095 x vocabulary floats); finite weights summing to infinity were
refused as 'q = 0'; a 3-byte transcript digest asked for a fragment named 616263."""


def undrafted(request: RoundRequest, decode_len: int) -> RoundRequest:
    """The round without drafts, asking the verifier to decode `decode_len` tokens."""
    return dataclasses.replace(request, drafts=(), q_rows=(), decode_len=decode_len)


async def opened(verifier: Verifier, rounds: int = 2, **kw):
    client = verifier.client(SAMPLED, epoch=3, **kw)
    await client.open_session()
    stream = await client.attach()
    await client.run(stream, rounds=rounds)
    return client, stream


async def expect_refused(verifier, client, stream, request_pb, code, reason) -> pb.RoundError:
    before = verifier.snapshot(client.session_id)
    msg, fragments = await stream.round_trip(request_pb)
    assert msg.WhichOneof("kind") == "error", msg
    assert not fragments
    err = msg.error
    assert (grpc.StatusCode(next(c for c in C if c.value[0] == err.code)), err.reason) == (
        code,
        reason,
    ), err.message
    assert err.message and err.round == request_pb.round
    assert verifier.snapshot(client.session_id) == before  # nothing written, nothing moved
    return err


async def finish_like_uncrashed(verifier, client, stream) -> None:
    """After any refusal the session goes on exactly as if it never happened."""
    await client.run(stream)
    twin = verifier.client(SAMPLED, epoch=3)
    await twin.open_session()
    twin_stream = await twin.attach()
    await twin.run(twin_stream)
    assert client.out == twin.out


@pytest.mark.parametrize("case", sorted(MUTATIONS))
async def test_bad_request_is_refused_and_writes_nothing(verifier, case):
    mutate, code, reason = MUTATIONS[case]
    client, stream = await opened(verifier)
    request = client.draft_request()
    await expect_refused(verifier, client, stream, client.sign(mutate(request)), code, reason)
    await finish_like_uncrashed(verifier, client, stream)


async def test_equivocation(verifier):
    client, stream = await opened(verifier, rounds=2)
    request = client.draft_request()
    msg, _ = await stream.round_trip(client.sign(request))
    client.accept(request, msg)
    other = dataclasses.replace(request, drafts=request.drafts[:-1], q_rows=request.q_rows[:-1])
    err = await expect_refused(
        verifier, client, stream, client.sign(other), C.ALREADY_EXISTS, "equivocation"
    )
    assert request.digest().hex() in err.message and other.digest().hex() in err.message


async def test_unenrolled_key_and_bad_signature(verifier, key_set):
    client, stream = await opened(verifier)
    request = client.draft_request()
    foreign = dataclasses.replace(request, proposer_key_id=client.key_id[::-1])
    await expect_refused(
        verifier, client, stream, client.sign(foreign, key_set.stranger),
        C.PERMISSION_DENIED, "unenrolled_key",
    )  # fmt: skip
    bad = client.sign(request)
    bad.signature = bytes([bad.signature[0] ^ 1]) + bad.signature[1:]
    await expect_refused(verifier, client, stream, bad, C.UNAUTHENTICATED, "bad_signature")
    await finish_like_uncrashed(verifier, client, stream)


async def test_a_draft_row_that_is_not_packed_arrays_is_malformed(verifier):
    client, stream = await opened(verifier)
    bad = client.sign(client.draft_request())
    bad.q_rows[0].weights = bad.q_rows[0].weights[:-3]  # not a whole number of f64
    err = await expect_refused(verifier, client, stream, bad, C.INVALID_ARGUMENT, "malformed")
    assert "draft row 0" in err.message and "multiple of 8 bytes" in err.message
    await finish_like_uncrashed(verifier, client, stream)


async def test_session_opened_by_another_enrolled_key_is_refused(verifier, key_set):
    client, stream = await opened(verifier)
    request = dataclasses.replace(client.draft_request(), proposer_key_id="0" * 16)
    await expect_refused(
        verifier, client, stream, client.sign(request), C.PERMISSION_DENIED, "unenrolled_key"
    )


async def test_missing_fragment_then_disagreeing_fragment(verifier):
    client, stream = await opened(verifier)
    request = client.draft_request()
    unknown_state = os.urandom(2500)
    digest = sha256(unknown_state)
    bad = dataclasses.replace(request, pre_state_digest=digest)
    err = await expect_refused(
        verifier, client, stream, client.sign(bad), C.FAILED_PRECONDITION, "missing_fragments"
    )
    assert list(err.missing) == [digest]
    await stream.fragment(digest, unknown_state)  # now held, hash-checked, and wrong
    err = await expect_refused(
        verifier, client, stream, client.sign(bad), C.FAILED_PRECONDITION, "fragment_mismatch"
    )
    assert "pre-round MT state" in err.message
    await finish_like_uncrashed(verifier, client, stream)


async def test_fragment_hash_mismatch(verifier):
    client, stream = await opened(verifier)
    before = verifier.snapshot(client.session_id)
    await stream.fragment(sha256(b"what was promised"), b"what was sent")
    msg = await stream.read()
    assert msg.WhichOneof("kind") == "error"
    assert (msg.error.code, msg.error.reason) == (C.DATA_LOSS.value[0], "fragment_hash_mismatch")
    assert sha256(b"what was sent").hex() in msg.error.message
    assert verifier.snapshot(client.session_id) == before
    assert len(verifier.manager.fragments) == 0
    await finish_like_uncrashed(verifier, client, stream)


async def test_fragments_nothing_names_are_bounded_per_session(key_set, tmp_path):
    """Regression: fragments sent on an attached stream were staged whatever their number
    (64 x 1 MiB nothing named stayed until an ack or the close). A session holds at most
    limits.max_message_bytes of them unacknowledged (each charged 64 bytes more); past it
    they are refused RESOURCE_EXHAUSTED fragments_full, and an ack makes room again."""
    v = await Verifier(
        make_config(key_set, tmp_path / "wal", max_message_bytes=16384), key_set, FakeBackend
    ).start()
    try:
        client, stream = await opened(v)
        before = v.snapshot(client.session_id)
        blobs = [os.urandom(5000) for _ in range(4)]
        for blob in blobs[:3]:  # 3 x 5064 = 15192 <= 16384
            await stream.fragment(sha256(blob), blob)
        await stream.fragment(sha256(blobs[0]), blobs[0])  # a duplicate is charged once
        await stream.fragment(sha256(blobs[3]), blobs[3])
        msg = await asyncio.wait_for(stream.read(), 10)  # (before: no answer, ever)
        assert (msg.error.code, msg.error.reason) == (
            C.RESOURCE_EXHAUSTED.value[0],
            "fragments_full",
        )
        assert "15192 bytes of fragments staged" in msg.error.message
        assert "limits.max_message_bytes = 16384" in msg.error.message
        assert len(v.manager.fragments) == 3 and v.snapshot(client.session_id) == before
        await stream.send(ack=pb.Ack(session_id=client.session_id, round=before[3]))
        await stream.fragment(sha256(blobs[3]), blobs[3])  # room again: no error follows
        await finish_like_uncrashed(v, client, stream)
        assert v.manager.fragments.held_by(client.session_id) == 5000 + 64
    finally:
        await v.stop()


async def test_unknown_session_and_unattached_stream(verifier):
    client, stream = await opened(verifier, rounds=0)
    seq = verifier.wal_seq
    stranger = verifier.client(SAMPLED)  # never opened
    s = await stranger.attach()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await s.read()
    assert caught.value.code() == C.NOT_FOUND
    assert stranger.session_id.hex() in caught.value.details()
    # a request for another session on an attached stream
    err = await expect_refused(
        verifier, client, stream, stranger.sign(stranger.draft_request()),
        C.INVALID_ARGUMENT, "not_attached",
    )  # fmt: skip
    assert err.message
    # a stream whose first message is not Attach
    s2 = stranger.stub.Rounds()
    await s2.write(pb.ProposerMessage(request=client.sign(client.draft_request())))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await s2.read()
    assert caught.value.code() == C.INVALID_ARGUMENT
    assert verifier.wal_seq == seq


async def test_oversized_message_is_refused_by_grpc(key_set, tmp_path):
    v = await Verifier(
        make_config(key_set, tmp_path / "wal", max_message_bytes=4096), key_set,
        __import__("tests.core.fake_backend", fromlist=["FakeBackend"]).FakeBackend,
    ).start()  # fmt: skip
    try:
        client = v.client(SAMPLED)
        huge = client.open_pb(fragments={sha256(b"x" * 8192): b"x" * 8192})
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await v.stub.OpenSession(huge)
        assert caught.value.code() == C.RESOURCE_EXHAUSTED
        assert v.wal_seq == 0
        await client.open_session()  # a normal-sized open still works
        stream = await client.attach()
        await client.run(stream, rounds=1)
        request = client.draft_request()
        big = dataclasses.replace(request, transcript_digests=request.transcript_digests * 200)
        before = v.snapshot(client.session_id)
        await stream.send(request=client.sign(big))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
        assert caught.value.code() == C.RESOURCE_EXHAUSTED
        assert v.snapshot(client.session_id) == before
    finally:
        await v.stop()


async def test_a_failed_commit_log_reports_not_serving_until_a_restart_recovers_it(
    key_set, tmp_path, monkeypatch
):
    """Issue 35: a commit log that failed an fsync refuses appends; the verifier says so
    (gRPC health, Status, /metrics, with the operator's remedy), refuses rounds and opens
    UNAVAILABLE up front (a proposer retries those), and a restart recovers the log: the
    session goes on from its last durable round as if nothing had happened."""
    import errno

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from muser.metrics import exposition
    from verifier_gx.servicer import metrics_view, status_json
    from wal import _fs

    config = make_config(key_set, tmp_path / "wal")
    v = await Verifier(config, key_set, FakeBackend).start()
    try:
        client, stream = await opened(v)
        real_fsync = _fs.fsync_file

        def failing_fsync(fd: int) -> None:  # the disk fails under the round's commit
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(_fs, "fsync_file", failing_fsync)
        seq = v.wal_seq
        draft = client.draft_request()
        request = client.sign(draft)
        await expect_refused(v, client, stream, request, C.UNAVAILABLE, "wal_failure")
        assert v.wal_seq == seq  # nothing acknowledged, the session did not move
        monkeypatch.setattr(_fs, "fsync_file", real_fsync)  # the disk is back: still refused
        err = await expect_refused(v, client, stream, request, C.UNAVAILABLE, "wal_failure")
        assert "restart the verifier once its disk takes writes again" in err.message
        health = health_pb2_grpc.HealthStub(v.channel)
        for service in ("", "muser.v2.Verifier"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        status = status_json(v.manager)
        assert status["serving"] is False
        assert status["faults"]["wal"].startswith("the commit log failed: fsync of ")
        assert status["faults"]["wal"].endswith(
            "restart the verifier once its disk takes writes again: it recovers the commit "
            "log at start, and sessions resume from their last durable round"
        )
        text = exposition(lambda: metrics_view(v.manager)).decode()
        assert "muser_serving 0.0" in text and 'muser_fault{component="wal",reason="the' in text
        other = v.client(SAMPLED, epoch=3)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await other.open_session()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await v.stop()
    again = await Verifier(config, key_set, FakeBackend).start()
    try:
        reply = await health_pb2_grpc.HealthStub(again.channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert status_json(again.manager)["faults"] == {}
        assert "muser_serving 1.0" in exposition(lambda: metrics_view(again.manager)).decode()
        client.stub = again.stub
        await client.open_session(fragments={})
        stream = await client.attach()
        # the round's record was written before its fsync failed: recovery found it whole,
        # so the same request is answered with it, as any retry of a committed round is
        msg, _ = await stream.round_trip(request)
        client.accept(draft, msg)
        await finish_like_uncrashed(again, client, stream)
    finally:
        await again.stop()


async def test_decode_len_past_what_the_session_may_emit(verifier):
    client = verifier.client(dataclasses.replace(SAMPLED, max_tokens=5), epoch=3, draft_len=0)
    await client.open_session()
    stream = await client.attach()
    err = await expect_refused(
        verifier, client, stream, client.sign(undrafted(client.draft_request(), 6)),
        C.INVALID_ARGUMENT, "decode_len",
    )  # fmt: skip
    assert "decode_len 6 received" in err.message and "may emit 5 more tokens" in err.message


async def test_decode_rounds_emit_exactly_their_singleton_rounds(verifier):
    runs = {}
    for decode_len in (1, 8):
        client = verifier.client(SAMPLED, epoch=3, draft_len=0, decode_len=decode_len)
        await client.open_session()
        await client.run(await client.attach())
        runs[decode_len] = client
    one, eight = runs[1], runs[8]
    assert eight.out == one.out and len(one.out) == SAMPLED.max_tokens
    assert (len(one.results), len(eight.results)) == (40, 5)


async def test_lookup_rounds_end_at_the_first_match_and_emit_the_singleton_rounds(verifier):
    """A decode round with a lookup rule ends after its first token that prompt lookup
    extends (or at decode_len): the text is the singleton rounds' all the same."""
    from muser.lookup import PromptLookup

    singles = verifier.client(SAMPLED, epoch=3, draft_len=0, decode_len=1)
    looked = verifier.client(SAMPLED, epoch=3, draft_len=0, decode_len=8, lookup=(1, 2))
    for client in (singles, looked):
        await client.open_session()
        await client.run(await client.attach())
    assert looked.out == singles.out and len(looked.out) == SAMPLED.max_tokens
    lookup, cut = PromptLookup(1, 2, looked.prompt), 0
    for signed in looked.results:
        emitted = RoundResult.decode(signed.body).emitted()
        matched = []
        for token in emitted:
            lookup.push(token)
            matched.append(lookup.proposal() is not None)
        assert not any(matched[:-1]), emitted  # no match passed over
        assert matched[-1] or len(emitted) == 8 or len(lookup) == len(looked.transcript)
        cut += matched[-1] and len(emitted) < 8
    assert cut >= 3 and 5 < len(looked.results) < 40  # rounds ended at matches, and ran on


async def test_a_round_wider_than_the_lane_says_so(verifier):
    client, stream = await opened(verifier)
    request = client.draft_request()
    wide = dataclasses.replace(request, drafts=request.drafts * 2, q_rows=request.q_rows * 2)
    err = await expect_refused(
        verifier, client, stream, client.sign(wide), C.INVALID_ARGUMENT, "too_many_drafts"
    )
    depth = 2 * len(request.drafts)
    assert err.message == (
        f"{depth} drafts received; this verifier's lane takes at most 4 a round "
        "(lane.draft_len_max)"
    )


async def test_a_fault_of_the_verifier_is_that_rounds_error_not_the_streams(verifier, monkeypatch):
    """Regression: an exception that is no MuserError while computing a round (the
    backend's out-of-memory, a bug) ended the whole stream with UNKNOWN. It is that round's
    INTERNAL error, in band; nothing is written, and the session goes on."""
    client, stream = await opened(verifier)
    import verifier_gx.executor as executor

    request = client.draft_request()
    failed = []

    def out_of_memory(*args, **kw):  # every try: the batch's, and the round's alone
        failed.append(True)
        raise RuntimeError("CUDA out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(executor, "evaluate_batch", out_of_memory)
        patch.setattr(executor.TargetExecutor, "witness_logits", out_of_memory)
        err = await expect_refused(
            verifier, client, stream, client.sign(request), C.INTERNAL, "internal"
        )
    assert "RuntimeError('CUDA out of memory')" in err.message and failed
    # the daemon says so (issue 35) until a forward succeeds again
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(verifier.channel)
    check = health_pb2.HealthCheckRequest(service="muser.v2.Verifier")

    async def status() -> int:
        for _ in range(100):  # the health servicer is updated on the loop, soon after
            reply = await health.Check(check)
            if (reply.status == health_pb2.HealthCheckResponse.SERVING) == (
                not verifier.manager.stats.faults
            ):
                return reply.status
            await asyncio.sleep(0.01)
        return reply.status

    assert verifier.manager.stats.faults == {
        "target": "the target backend raised RuntimeError('CUDA out of memory') on a forward"
    }
    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    await finish_like_uncrashed(verifier, client, stream)
    assert verifier.manager.stats.faults == {}
    assert await status() == health_pb2.HealthCheckResponse.SERVING


async def test_a_message_that_does_not_parse_is_malformed(verifier):
    """Regression: bytes that are no ProposerMessage (a string field that is not UTF-8)
    ended the stream with UNKNOWN; it is INVALID_ARGUMENT malformed."""
    client, stream = await opened(verifier, rounds=0)
    request = pb.ProposerMessage(request=client.sign(client.draft_request()))
    raw = request.SerializeToString()
    key_id = client.key_id.encode()
    assert raw.count(key_id) == 1
    raw = raw.replace(key_id, b"\xff" * len(key_id))  # the same length: still framed
    channel_call = verifier.channel.stream_stream(  # raw bytes: the stub would serialise
        "/muser.v2.Verifier/Rounds",
        request_serializer=lambda b: b,
        response_deserializer=pb.VerifierMessage.FromString,
    )()
    await channel_call.write(
        pb.ProposerMessage(
            attach=pb.Attach(session_id=client.session_id, epoch=3)
        ).SerializeToString()
    )
    await channel_call.write(raw)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        while True:
            msg = await channel_call.read()
            assert msg is not grpc.aio.EOF
    assert caught.value.code() == C.INVALID_ARGUMENT
    assert caught.value.details().startswith("malformed: a message of the stream is not")
