"""The proposer's link to a verifier: open sessions, one Rounds stream per session.

A round trip sends one signed request and waits for its result. The verifier's in-band
refusals come back as `RoundRefused` (code, reason, message); a `missing_fragments` refusal
is answered here by sending the named fragments and the same request again. A broken stream
(verifier restart, cut connection) raises `LinkDown`; the driver reconnects with backoff and
re-sends the same PREPARED bytes, which the verifier answers from its WAL.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import grpc

from muser.errors import MuserError
from muser.records import Signed
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc


class LinkDown(MuserError):
    """The stream to the verifier broke; retry after reconnecting."""


class RoundRefused(MuserError):
    """The verifier refused a request (in-band RoundError or an RPC status)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(f"verifier refused ({code.name}, {reason}): {message}")
        self.code, self.reason, self.detail = code, reason, message


RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class RoundStream:
    """One attached Rounds stream for one session."""

    def __init__(self, stub: pb_grpc.VerifierStub, session_id: bytes, epoch: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.call = stub.Rounds(self._requests())
        self.session_id = session_id
        self.queue.put_nowait(
            pb.ProposerMessage(attach=pb.Attach(session_id=session_id, epoch=epoch))
        )
        self.captured_bytes = 0
        """Capture-row fragment bytes received (hash-checked; no consumer keeps them yet)."""

    async def _requests(self):
        while True:
            msg = await self.queue.get()
            if msg is None:
                return
            yield msg

    async def _next(self) -> pb.VerifierMessage:
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRYABLE:
                raise LinkDown(f"round stream broke: {exc.code().name}: {exc.details()}") from exc
            raise RoundRefused(exc.code(), "rpc", exc.details() or "") from exc
        if msg is grpc.aio.EOF:
            raise LinkDown("the verifier closed the round stream")
        return msg

    async def round_trip(
        self, signed_request: Signed, fragments: Callable[[], dict[bytes, bytes]]
    ) -> tuple[Signed, pb.RoundResult]:
        request = convert.request_to_pb(signed_request)
        sent_fragments = False
        self.queue.put_nowait(pb.ProposerMessage(request=request))
        while True:
            msg = await self._next()
            kind = msg.WhichOneof("kind")
            if kind == "fragment":
                if hashlib.sha256(msg.fragment.data).digest() != msg.fragment.digest:
                    raise RoundRefused(
                        grpc.StatusCode.DATA_LOSS,
                        "fragment_hash_mismatch",
                        "a capture fragment does not hash to its digest",
                    )
                self.captured_bytes += len(msg.fragment.data)
            elif kind == "result":
                return convert.result_from_pb(msg.result), msg.result
            elif kind == "error":
                err = msg.error
                if err.reason == "missing_fragments" and not sent_fragments:
                    held = fragments()
                    for digest in err.missing:
                        if digest in held:
                            self.queue.put_nowait(
                                pb.ProposerMessage(
                                    fragment=pb.Fragment(digest=digest, data=held[digest])
                                )
                            )
                    sent_fragments = True
                    self.queue.put_nowait(pb.ProposerMessage(request=request))
                    continue
                code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
                raise RoundRefused(code, err.reason, err.message)

    def ack(self, round_: int) -> None:
        self.queue.put_nowait(
            pb.ProposerMessage(ack=pb.Ack(session_id=self.session_id, round=round_))
        )

    def close(self) -> None:
        self.queue.put_nowait(None)
        self.call.cancel()
