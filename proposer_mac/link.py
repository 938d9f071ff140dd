"""The proposer's link to a verifier: open sessions, one Rounds stream per session.

A round trip sends one signed request and waits for its result. Messages are written on the
call directly (no request-iterator task between the driver and the wire), and the caller
hears when its request is on the wire (`on_sent`: the driver starts its speculation then,
so the speculative draft never competes with the send), and the verifier's early decision
on the round (`on_decision`: a hint to draft the next round on). The verifier's in-band
refusals come back as `RoundRefused` (code, reason, message); a `missing_fragments` refusal
is answered here by sending the named fragments and the same request again. A broken stream
(verifier restart, cut connection) raises `LinkDown`; the driver reconnects with backoff and
re-sends the same PREPARED bytes, which the verifier answers from its WAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Sequence

import grpc

from muser import faults
from muser.errors import MuserError
from muser.records import Signed
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc


class LinkDown(MuserError):
    """The stream to the verifier broke; retry after reconnecting."""

    code = grpc.StatusCode.UNAVAILABLE
    """What a client is told when it cannot be retried for it (a session's first open)."""


class RoundRefused(MuserError):
    """The verifier refused a request (in-band RoundError or an RPC status)."""

    def __init__(
        self, code: grpc.StatusCode, reason: str, message: str, missing: Sequence[bytes] = ()
    ):
        super().__init__(f"verifier refused ({code.name}, {reason}): {message}")
        self.code, self.reason, self.detail = code, reason, message
        self.missing = list(missing)
        """The fragment digests a missing_fragments refusal names."""


def fenced(exc: RoundRefused) -> bool:
    """The verifier refused the session's epoch as stale: it holds the session at a higher
    one (in-band, or as an attach's or an open's status, whose details lead with the reason)."""
    return exc.reason == "stale_epoch" or exc.detail.startswith("stale_epoch:")


RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}

_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RoundStream:
    """One Rounds stream for one session; `attach` before the first round trip."""

    def __init__(
        self,
        stub: pb_grpc.VerifierStub,
        session_id: bytes,
        epoch: int,
        on_sent: Callable[[int], None] | None = None,
    ):
        self.call = stub.Rounds()
        self.on_sent = on_sent
        """Told the bytes of each fragment sent (the pool counts them)."""
        self.session_id, self.epoch = session_id, epoch
        self._writing = asyncio.Lock()
        """One write at a time: an ack may go while a round trip writes fragments."""
        self.captured_bytes = 0
        """Capture-row fragment bytes received (hash-checked)."""
        self.captures: dict[bytes, bytes] = {}
        """The capture fragments that came with the last round trip's result, by digest
        (muser.capture; the driver takes those its signed result names)."""

    async def attach(self) -> RoundStream:
        try:
            await self._write(
                pb.ProposerMessage(attach=pb.Attach(session_id=self.session_id, epoch=self.epoch))
            )
        except MuserError:
            self.close()  # nobody else holds this stream to close it
            raise
        return self

    async def _write(self, msg: pb.ProposerMessage) -> None:
        try:
            async with self._writing:
                await self.call.write(msg)
        except grpc.aio.AioRpcError as exc:
            raise self._broken(exc.code(), exc.details()) from exc
        except asyncio.InvalidStateError as exc:  # the call ended: its status says why
            code = await self.call.code() if self.call.done() else grpc.StatusCode.UNKNOWN
            details = await self.call.details() if self.call.done() else str(exc)
            raise self._broken(code, details) from exc

    @staticmethod
    def _broken(code: grpc.StatusCode, details: str | None) -> MuserError:
        if code in RETRYABLE:
            return LinkDown(f"round stream broke: {code.name}: {details}")
        return RoundRefused(code, "rpc", details or "")

    async def _next(self) -> pb.VerifierMessage:
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._broken(exc.code(), exc.details()) from exc
        if msg is grpc.aio.EOF:
            raise LinkDown("the verifier closed the round stream")
        return msg

    async def round_trip(
        self,
        signed_request: Signed,
        fragments: Callable[[], dict[bytes, bytes]],
        on_sent: Callable[[], None] | None = None,
        on_decision: Callable[[pb.Decision], None] | None = None,
        sent: pb.RoundRequest | None = None,
    ) -> tuple[Signed, pb.RoundResult]:
        """Send the request (unless `send` already put it, `sent`, on this stream), answer a
        missing_fragments refusal once, return the result. `on_decision` hears the verifier's
        early decision on this round (unsigned: a hint)."""
        request = sent if sent is not None else await self.send(signed_request)
        self.captures = {}
        if on_sent is not None:
            on_sent()
        sent_fragments = False
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
                self.captures[msg.fragment.digest] = msg.fragment.data
            elif kind == "decision":
                if on_decision is not None and msg.decision.round == request.round:
                    on_decision(msg.decision)
            elif kind == "result":
                return convert.result_from_pb(msg.result), msg.result
            elif kind == "error":
                err = msg.error
                if err.reason == "missing_fragments" and not sent_fragments:
                    held = fragments()
                    for digest in err.missing:
                        if digest in held:
                            fragment = pb.Fragment(digest=digest, data=held[digest])
                            await self._write(pb.ProposerMessage(fragment=fragment))
                            if self.on_sent is not None:
                                self.on_sent(len(fragment.data))
                    sent_fragments = True
                    await self._write(pb.ProposerMessage(request=request))
                    continue
                code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
                if code == grpc.StatusCode.UNAVAILABLE:  # (its commit log failed) retried
                    raise LinkDown(f"the verifier cannot commit now: {err.reason}: {err.message}")
                raise RoundRefused(code, err.reason, err.message)

    async def send(self, signed_request: Signed) -> pb.RoundRequest:
        """Put a request on the stream; its result is read by a `round_trip` given it."""
        request = convert.request_to_pb(signed_request)
        await self._write(pb.ProposerMessage(request=request))
        return request

    async def ack(self, round_: int) -> None:
        """Best effort: a lost ack only keeps fragments staged at the verifier longer, and a
        broken stream shows at the next round trip."""
        with contextlib.suppress(MuserError):
            await self._write(
                pb.ProposerMessage(ack=pb.Ack(session_id=self.session_id, round=round_))
            )
            faults.reached("proposer.after_ack")

    async def look_ahead(self, round_: int, after: list[int], drafts: list[int]) -> None:
        """Best effort, like `ack`: name the drafts of round `round_`, drafted on the round
        before emitting `after`, ahead of its request (the verifier may evaluate them early);
        a lost hint costs only that head start."""
        with contextlib.suppress(MuserError):
            await self._write(
                pb.ProposerMessage(lookahead=pb.Lookahead(round=round_, after=after, drafts=drafts))
            )

    def close(self) -> None:
        self.call.cancel()
