"""Fuzzed input on the verifier's gRPC surface (issue 34): random bytes, truncated, bit-flipped
and padded copies of valid messages, out-of-order stream messages and replays, sent to
OpenSession, CloseSession and Rounds of a verifier that serves a live session meanwhile.

Each case gets a clear answer (a gRPC status other than UNKNOWN or INTERNAL, with details, or
a RoundError on the stream, or, for a replay that is valid, the stored answer); no refused
case moves the WAL or the live session; and the live session runs to its end afterwards.
The default suite tries 1,000 cases, `slow` 20,000."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from muser.sampling import SamplingParams
from muser.wire import muser_v2_pb2 as pb
from tests.core.fake_backend import FakeBackend
from tests.fuzzing import cases, unhandled_errors
from tests.verifier.conftest import Verifier, make_config

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED}
"""What a malformed input must never get: a status that says nothing about it."""
CLIENT_CUT = "Internal error from Core"
"""What a gRPC client reports, instead of the server's status, when it wrote on a call the
server had already ended (a race of this fuzzer's writes with the verifier's refusal)."""
SERVICE = "/" + pb.DESCRIPTOR.services_by_name["Verifier"].full_name
WAIT_S = 10.0
"""The longest one case may take to be answered: a hang fails the test."""


def mutations(valid: list[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes, or one of `valid` truncated, with a byte flipped, or with junk after it
    (protobuf reads unknown trailing fields: some of these parse, and must still be refused
    or answered as the valid message would be)."""
    base = st.sampled_from(valid)
    truncated = st.builds(lambda b, f: b[: int(len(b) * f)], base, st.floats(0, 0.999))
    flipped = st.builds(
        lambda b, i, bit: b[: i % len(b)] + bytes([b[i % len(b)] ^ (1 << bit)]) + b[i % len(b) + 1 :],
        base, st.integers(0, 1 << 16), st.integers(0, 7),
    )  # fmt: skip
    padded = st.builds(lambda b, junk: b + junk, base, st.binary(min_size=1, max_size=40))
    return st.binary(max_size=400) | truncated | flipped | padded | base


class Fuzz:
    """The verifier, its live session and the valid messages the cases start from."""

    def __init__(self, key_set, tmp_path) -> None:
        self.loop = asyncio.new_event_loop()
        self.v = Verifier(make_config(key_set, tmp_path / "wal"), key_set, FakeBackend)
        self.run(self.v.start())
        self.client = self.v.client(PARAMS)
        self.run(self.client.open_session())
        c = self.client
        stream = self.run(c.attach())
        committed = []  # requests the verifier committed: sent again, they are replays
        for _ in range(2):
            request = c.draft_request()
            committed.append(c.sign(request))
            c.accept(request, self.run(stream.round_trip(committed[-1]))[0])
        self.run(stream.close())
        self.opens = [c.open_pb().SerializeToString()]
        attach = pb.ProposerMessage(attach=pb.Attach(session_id=c.session_id, epoch=c.epoch))
        self.messages = [
            attach.SerializeToString(),
            *(pb.ProposerMessage(request=r).SerializeToString() for r in committed),
            pb.ProposerMessage(ack=pb.Ack(round=0)).SerializeToString(),
            *(
                pb.ProposerMessage(fragment=pb.Fragment(digest=d, data=data)).SerializeToString()
                for d, data in c.fragments().items()
            ),
        ]
        self.closes = [pb.CloseSessionRequest(session_id=c.session_id).SerializeToString()]
        raw = {"request_serializer": None, "response_deserializer": None}
        channel = self.v.channel
        self.open_call = channel.unary_unary(f"{SERVICE}/OpenSession", **raw)
        self.close_call = channel.unary_unary(f"{SERVICE}/CloseSession", **raw)
        self.rounds_call = channel.stream_stream(f"{SERVICE}/Rounds", **raw)
        self.before = self.v.snapshot(c.session_id)
        self.cases = 0

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, WAIT_S))

    def unchanged(self) -> None:
        """The live session and the WAL position as they were (`Verifier.snapshot`)."""
        assert self.v.snapshot(self.client.session_id) == self.before

    async def unary(self, call, data: bytes) -> None:
        try:
            await call(data)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() not in UNCLEAR, (exc.code(), exc.details(), data)
            assert exc.details(), (exc.code(), data)

    async def stream(self, messages: list[bytes]) -> None:
        call, cut = self.rounds_call(), False
        try:
            for m in messages:
                await call.write(m)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            cut = True  # the verifier ended the call before all was written
        replies = []
        try:
            async for reply in call:
                replies.append(pb.VerifierMessage.FromString(reply).WhichOneof("kind"))
        except grpc.aio.AioRpcError:
            pass
        code, details = await call.code(), await call.details()
        assert set(replies) <= {"error", "result", "decision", "fragment"}, replies
        if cut and (code, details) == (grpc.StatusCode.INTERNAL, CLIENT_CUT):
            return  # this client's own status for writes after the end (the log check sees
            # the verifier's side)
        if code != grpc.StatusCode.OK:
            assert code not in UNCLEAR, (code, details, messages)
            assert details, (code, messages)

    def finish(self) -> None:
        """The live session goes on to its end: the daemon kept serving."""
        c = self.client
        stream = self.run(c.attach())
        self.loop.run_until_complete(asyncio.wait_for(c.run(stream), 60))
        self.run(stream.close())
        assert c.done and len(c.out) == PARAMS.max_tokens
        self.run(self.v.stop())
        self.loop.close()


def fuzz_all(key_set, tmp_path, examples: int) -> int:
    """Run `examples` cases on each of the three calls; returns the count tried."""
    with unhandled_errors() as errors:
        f = Fuzz(key_set, tmp_path)
        fuzz = cases(examples)
        try:

            @fuzz
            @given(data=mutations(f.opens))
            def opens(data):
                f.run(f.unary(f.open_call, data))
                f.unchanged()  # a replayed open is answered without moving the session
                f.cases += 1

            @fuzz
            @given(data=st.binary(max_size=200) | mutations(f.closes))
            def closes(data):
                # the live session's own close is the one input that may act: left out
                if data == f.closes[0]:
                    return
                f.run(f.unary(f.close_call, data))
                f.unchanged()
                f.cases += 1

            @fuzz
            @given(messages=st.lists(mutations(f.messages), min_size=1, max_size=4))
            def rounds(messages):
                f.run(f.stream(messages))
                f.unchanged()  # a replayed request gets its stored result; nothing else acts
                f.cases += 1

            opens()
            closes()
            rounds()
        finally:
            f.finish()
        assert [r.getMessage() for r in errors] == []  # no input reached an unhandled exception
        return f.cases


def test_a_thousand_fuzzed_inputs_get_clear_answers_and_change_nothing(key_set, tmp_path):
    assert fuzz_all(key_set, tmp_path, 350) >= 1000


@pytest.mark.slow
def test_twenty_thousand_fuzzed_inputs_get_clear_answers_and_change_nothing(key_set, tmp_path):
    assert fuzz_all(key_set, tmp_path, 7000) >= 20000
