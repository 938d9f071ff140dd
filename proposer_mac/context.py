"""What every session's round driver shares (`DriverContext`): the proposer's keys, the
enrolled verifier keys, the journal, the channel to the verifier and its stub, the one draft
thread and the lane's speculation settings; and the session calls made outside a round
(open or re-open, attach a Rounds stream, close)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys
from muser.backend import MultiSequenceBackend
from muser.records import close_message
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from proposer_mac.draft_queue import DraftQueue
from proposer_mac.link import LinkDown, RoundRefused, RoundStream
from proposer_mac.session import ProposerSession

log = logging.getLogger("muser.proposer")


OPEN_S = 30
"""Seconds a session open waits for the verifier (its channel reconnecting meanwhile)."""


class DriverContext:
    """What every session runner shares: keys, the journal, the verifier channel, the
    draft thread."""

    def __init__(
        self,
        *,
        private: keys.SigningKey,
        verifiers: dict[str, Ed25519PublicKey],
        log,
        channel: grpc.aio.Channel,
        verifier_address: str = "the verifier",
        speculate: bool = True,
        branches: int = 2,
        batch_with: MultiSequenceBackend | None = None,
        lookahead: bool = False,
        send_on_decision: bool = False,
        on_draft=None,
    ):
        self.private, self.verifiers, self.log = private, verifiers, log
        self.speculate = speculate
        """Draft round r+1 while round r is at the verifier (lane.speculate)."""
        self.send_on_decision = send_on_decision
        """Journal and send the next round's request on the early decision of the round in
        flight (lane.send_on_decision; `SendAhead.send`)."""
        self.lookahead = lookahead
        """Name each round drafted ahead to the verifier before its request (lane.lookahead,
        resolved)."""
        self.branches = branches
        """Greedy: draft it on the first `branches` rejection points too, each with the
        draft's runner-up there (lane.speculate_branches; 0: full acceptance only)."""
        self.stub = pb_grpc.VerifierStub(channel)
        self.verifier_address = verifier_address
        """For messages: where `channel` leads."""
        self.draft_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.drafts = DraftQueue(self.draft_pool, batch_with, on_draft)

    async def open_remote(self, s: ProposerSession) -> None:
        """Open (or idempotently re-open) the session on the verifier; past genesis the open
        carries the last committed round, so a verifier without it resumes from it."""
        resume, chunks, fragments = s.resume_point()
        body = s.open.signed_message(s.epoch, resume)
        request = convert.open_to_pb(
            s.open, s.epoch, self.private.sign(body), fragments, resume, chunks
        )
        try:
            reply = await self.stub.OpenSession(request, wait_for_ready=True, timeout=OPEN_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise LinkDown(
                    f"open session: no answer from the verifier at {self.verifier_address} "
                    f"within {OPEN_S} s ({exc.code().name}: {exc.details()}); is it running? "
                    "(`muser status --config FILE`)"
                ) from exc
            raise RoundRefused(exc.code(), "open", exc.details() or "") from exc
        if reply.resumed:
            log.warning(
                "session %s: verifier %s did not hold round %d; it resumed from this proposer's "
                "signed round", s.session_id.hex()[:8], reply.verifier_key_id, s.next_round - 1,
            )  # fmt: skip

    async def close_remote(self, s: ProposerSession) -> None:
        """Tell the verifier the session is finished so it stops holding it (best effort:
        a finished session that stays open there is only answered from its WAL)."""
        request = pb.CloseSessionRequest(
            session_id=s.session_id,
            epoch=s.epoch,
            signature=self.private.sign(close_message(s.session_id, s.epoch)),
        )
        try:
            await self.stub.CloseSession(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "session %s: closing it on the verifier failed: %s: %s",
                s.session_id.hex()[:8],
                exc.code().name,
                exc.details(),
            )

    async def attach(self, s: ProposerSession) -> RoundStream:
        await self.open_remote(s)
        return await RoundStream(self.stub, s.session_id, s.epoch).attach()
