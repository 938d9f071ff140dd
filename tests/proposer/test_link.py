"""The round stream: requests written on the call directly, `on_sent` heard between the
write and the wait for the result, broken calls turned into LinkDown or RoundRefused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from muser import keys
from muser.records import RoundRequest, RoundResult, Signed
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from proposer_mac.link import LinkDown, RoundRefused, RoundStream

pytestmark = pytest.mark.asyncio

SID = bytes(16)


class FakeCall:
    """A Rounds call: records what is written and what happened when; answers reads from a
    queue; can end with a status (then writes raise InvalidStateError, as grpc.aio's do)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.written: list[pb.ProposerMessage] = []
        self.replies: asyncio.Queue = asyncio.Queue()
        self.status: grpc.StatusCode | None = None

    async def write(self, msg) -> None:
        if self.status is not None:
            raise asyncio.InvalidStateError("RPC already finished")
        self.written.append(msg)
        self.events.append(f"write {msg.WhichOneof('kind')}")

    async def read(self):
        self.events.append("read")
        return await self.replies.get()

    def done(self) -> bool:
        return self.status is not None

    async def code(self):
        return self.status

    async def details(self):
        return "the verifier went away"

    def cancel(self) -> None:
        self.events.append("cancel")


class FakeStub:
    def __init__(self, call: FakeCall) -> None:
        self.call = call

    def Rounds(self):  # noqa: N802 (the generated stub's name)
        return self.call


def a_round() -> tuple[Signed, pb.VerifierMessage]:
    key = keys.generate()
    request = RoundRequest(SID, 0, 1, bytes(32), 5, (), (), bytes(32), (), "p", 1)
    signed_request = Signed.of(request, key.sign)
    result = RoundResult(
        SID, 0, 1, bytes(32), request.digest(), 5, (), 0, 7, bytes(32), bytes(32), (),
        bytes(32), "v",
    )  # fmt: skip
    signed_result = Signed.of(result, key.sign)
    return signed_request, pb.VerifierMessage(result=convert.result_to_pb(signed_result))


async def test_the_request_is_written_then_on_sent_runs_then_the_result_is_read():
    events: list[str] = []
    call = FakeCall(events)
    stream = await RoundStream(FakeStub(call), SID, 1).attach()
    signed_request, reply = a_round()
    call.replies.put_nowait(reply)
    signed, raw = await stream.round_trip(
        signed_request, dict, on_sent=lambda: events.append("sent")
    )
    assert events == ["write attach", "write request", "sent", "read"]
    assert raw.next_frontier == 7 and signed.signature == reply.result.signature
    await stream.ack(0)
    assert call.written[-1].ack.round == 0


@pytest.mark.parametrize(
    "status, raised",
    [(grpc.StatusCode.UNAVAILABLE, LinkDown), (grpc.StatusCode.PERMISSION_DENIED, RoundRefused)],
)
async def test_a_write_on_an_ended_call_says_why_by_its_status(status, raised):
    call = FakeCall([])
    stream = await RoundStream(FakeStub(call), SID, 1).attach()
    call.status = status
    signed_request, _ = a_round()
    sent = []
    with pytest.raises(raised, match=status.name if raised is LinkDown else "went away"):
        await stream.round_trip(signed_request, dict, on_sent=lambda: sent.append(1))
    assert sent == []  # nothing went out: no speculation starts on it
    await stream.ack(0)  # best effort: a broken stream shows at the next round trip


async def test_an_attach_that_cannot_be_written_cancels_its_call():
    events: list[str] = []
    call = FakeCall(events)
    call.status = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(LinkDown):
        await RoundStream(FakeStub(call), SID, 1).attach()
    assert events == ["cancel"]
