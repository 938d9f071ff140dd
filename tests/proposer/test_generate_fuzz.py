"""Fuzzed input on the proposer's gRPC surface (issue 34): Generate requests with any field
values (prompts of any ids, sampling parameters out of range, unknown or half-known session
ids and offsets), and random or mangled bytes, against a proposer that serves a live client
meanwhile.

Each case either streams a session to its end (a valid request) or gets a clear status
(never UNKNOWN or INTERNAL, details present); a refused request adds nothing to the journal;
gRPC logs no unhandled exception; and the proposer still generates correctly afterwards.
The default suite tries 500 cases (with the HTTP API's 500 in tests/http/test_request_fuzz.py,
1,000 on the proposer), `slow` 10,000."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from muser.sampling import SamplingParams
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend
from tests.fuzzing import cases, unhandled_errors
from tests.proposer.test_generate_service import start, stop
from tests.verifier.conftest import PROMPT

UNCLEAR = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED}
SERVICE = "/" + pb.DESCRIPTOR.services_by_name["Proposer"].full_name
WAIT_S = 30.0
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=3)

U32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
PARAMS_PB = st.builds(
    pb.SamplingParams,
    temperature=FLOATS,
    top_k=st.integers(0, 70) | U32,
    top_p=FLOATS,
    max_tokens=st.integers(0, 12) | U32,  # long valid sessions would only slow the fuzzer
    stop_tokens=st.lists(st.integers(0, 40) | U32, max_size=3),
    seed=U32,
)


def requests(live: bytes) -> st.SearchStrategy[pb.GenerateRequest]:
    """Field values of every kind; `live` is a session id the proposer holds (a reconnect
    to it at any offset is a valid request, and must get a clear answer too)."""
    session_ids = st.just(b"") | st.binary(max_size=20) | st.just(live)
    return st.builds(
        pb.GenerateRequest,
        prompt=st.text(max_size=30),
        prompt_tokens=st.lists(st.integers(0, 40) | U32, max_size=8),
        params=PARAMS_PB,
        session_id=session_ids,
        offset=st.integers(0, 20) | st.integers(0, 2**64 - 1),
        draft_len=st.integers(0, 8) | U32,
    )


def mangled(valid: bytes) -> st.SearchStrategy[bytes]:
    cut = st.builds(lambda f: valid[: int(len(valid) * f)], st.floats(0, 0.999))
    junk = st.builds(lambda b: valid + b, st.binary(min_size=1, max_size=30))
    return st.binary(max_size=200) | cut | junk


class Fuzz:
    def __init__(self, key_set, tmp_path) -> None:
        self.loop = asyncio.new_event_loop()
        self.c = self.run(start(key_set, tmp_path))
        self.live = self.run(self.c.generate(PARAMS, prompt_tokens=PROMPT))[0].session_id
        raw = {"request_serializer": None, "response_deserializer": None}
        self.call = self.c.channel.unary_stream(f"{SERVICE}/Generate", **raw)
        self.valid = pb.GenerateRequest(
            prompt_tokens=PROMPT, params=convert.params_to_pb(PARAMS)
        ).SerializeToString()

    def run(self, coro, timeout: float = WAIT_S):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    @property
    def journal_seq(self) -> int:
        return self.c.server.core.log.last_seq

    async def generate(self, data: bytes) -> bool:
        """True when the request was served (its stream ran to `done`)."""
        events = []
        try:
            async for reply in self.call(data):
                events.append(pb.GenerateEvent.FromString(reply))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() not in UNCLEAR, (exc.code(), exc.details(), data)
            assert exc.details(), (exc.code(), data)
            return False
        assert events and events[-1].done, events
        return True

    def case(self, data: bytes) -> None:
        seq = self.journal_seq
        if not self.run(self.generate(data)):
            assert self.journal_seq == seq  # a refused request journals nothing

    def finish(self) -> None:
        events = self.run(self.c.generate(PARAMS, prompt_tokens=PROMPT))
        local = run_local(FakeBackend(), FakeBackend(order=1, salt=1), PROMPT, PARAMS, q_top_k=32)
        assert [t for e in events for t in e.tokens] == local.tokens  # still serving, exact
        self.run(stop(self.c))
        self.loop.close()


def fuzz_all(key_set, tmp_path, examples: int) -> None:
    with unhandled_errors() as errors:
        f = Fuzz(key_set, tmp_path)
        fuzz = cases(examples)
        try:

            @fuzz
            @given(request=requests(f.live))
            def fields(request):
                f.case(request.SerializeToString())

            @fuzz
            @given(data=mangled(f.valid))
            def raw(data):
                f.case(data)

            fields()
            raw()
        finally:
            f.finish()
        assert [r.getMessage() for r in errors] == []  # no input reached an unhandled exception


def test_five_hundred_fuzzed_generate_requests_get_clear_answers(key_set, tmp_path):
    fuzz_all(key_set, tmp_path, 250)


@pytest.mark.slow
def test_ten_thousand_fuzzed_generate_requests_get_clear_answers(key_set, tmp_path):
    fuzz_all(key_set, tmp_path, 5000)
