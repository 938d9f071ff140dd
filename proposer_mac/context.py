"""What every session's round driver shares (`DriverContext`): the proposer's keys, the
enrolled verifier keys, the journal, the verifier pool (a channel to each verifier,
`proposer_mac.pool`), the one draft thread and the lane's speculation settings; and the
session calls made outside a round (open or re-open, attach a Rounds stream, close), each
on the verifier the session lives on."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys
from muser.backend import MultiSequenceBackend
from muser.records import close_message
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from proposer_mac import journal
from proposer_mac.draft_queue import DraftQueue
from proposer_mac.link import LinkDown, RoundRefused, RoundStream
from proposer_mac.pool import Member, VerifierPool
from proposer_mac.session import ProposerSession

log = logging.getLogger("muser.proposer")


OPEN_S = 30
"""Seconds a session open waits for the verifier (its channel reconnecting meanwhile)."""
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""An open's or a close's answers that mean "no answer yet": tried again."""
FENCE_S = 600
"""Seconds a verifier a session left is tried, to tell it the new epoch (`fence`)."""


class DriverContext:
    """What every session runner shares: keys, the journal, the verifier channel, the
    draft thread."""

    def __init__(
        self,
        *,
        private: keys.SigningKey,
        verifiers: dict[str, Ed25519PublicKey],
        log,
        pool: VerifierPool,
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
        self.pool = pool
        self.draft_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        self.drafts = DraftQueue(self.draft_pool, batch_with, on_draft)

    def home(self, s: ProposerSession) -> Member:
        """The verifier the session lives on."""
        return self.pool.home_of(s.home)

    async def open_remote(self, s: ProposerSession, on: Member | None = None) -> None:
        """Open (or idempotently re-open) the session on the verifier it lives on (or `on`:
        a verifier it left, told its epoch); past genesis the open carries the last
        committed round, so a verifier without it resumes from it. Waits `OPEN_S` for an
        answer, or proposer.failover_s when the pool has another verifier to move to."""
        member = on or self.home(s)
        resume, chunks, fragments = s.resume_point()
        signature = self.private.sign(s.open.signed_message(s.epoch, resume))
        # once a verifier answered the session, an open names its prompt, transcript and MT
        # state by digest only: a verifier holding them (its own state of the session, its
        # fragment store) needs no bytes; one lacking some names them (missing_fragments),
        # and one more open carries just those. A session's first open carries its prompt.
        send = fragments if s.signer is None and not resume else {}
        while True:
            self.pool.fragment_bytes += sum(map(len, send.values()))
            request = convert.open_to_pb(s.open, s.epoch, signature, send, resume, chunks)
            try:
                reply = await self._open_call(member, request)
                break
            except RoundRefused as exc:
                lacking = {d: fragments[d] for d in exc.missing if d in fragments}
                if exc.reason != "missing_fragments" or not lacking or send:
                    raise
                send = lacking
        if self.pool.pooled and reply.verifier_key_id != member.key_id:
            raise RoundRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                "wrong_verifier",
                f"the verifier at {member.address} answered with key {reply.verifier_key_id}; "
                f"pool verifier {member.name!r} is key {member.key_id} ([[pool]] public_key)",
            )
        if on is not None:
            return  # a verifier left: its answer says nothing of whose results to take
        if s.tree is not None and "tree-rounds" not in reply.features:
            raise RoundRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "tree_rounds_unsupported",
                f"the verifier at {member.address} judges chains only (features "
                f"{list(reply.features)}; an older verifier, or one whose lane.tree_nodes is 0 "
                f"or whose target is not torch); this proposer drafts trees (lane.tree_nodes; "
                f"its tree policy: {s.tree.to_dict()}): use the same cluster file on both "
                "daemons, or set lane.tree_nodes = 0",
            )
        if s.tree is not None and s.open.capture_layers and "capture-trees" not in reply.features:
            raise RoundRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "tree_rounds_unsupported",
                f"the verifier at {member.address} judges trees but captures the rows of chains "
                f"only (features {list(reply.features)}: an older verifier); "
                f"this session captures layers {list(s.open.capture_layers)} and drafts trees "
                "(lane.tree_nodes): upgrade the verifier, or set lane.tree_nodes = 0",
            )
        fit_decode(s, reply.features)
        s.signer = reply.verifier_key_id
        if reply.resumed:
            log.warning(
                "session %s: verifier %s did not hold round %d; it resumed from this proposer's "
                "signed round", s.session_id.hex()[:8], reply.verifier_key_id, s.next_round - 1,
            )  # fmt: skip

    async def _open_call(self, member: Member, request: pb.OpenSessionRequest):
        """One OpenSession call: LinkDown when unanswered (`OPEN_S`, or proposer.failover_s
        when the pool has another verifier to move to), RoundRefused (with the digests a
        missing_fragments refusal names) when refused."""
        wait = self.pool.failover_s if self.pool.pooled else OPEN_S
        try:
            return await member.stub.OpenSession(request, wait_for_ready=True, timeout=wait)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in RETRY_CODES:
                where = (
                    f"verifier {member.name!r} at {member.address}"
                    if self.pool.pooled
                    else f"the verifier at {member.address}"
                )
                raise LinkDown(
                    f"open session: no answer from {where} within {wait:g} s "
                    f"({exc.code().name}: {exc.details()}); is it running? (`muser status "
                    "--config FILE`)"
                ) from exc
            meta = dict(exc.trailing_metadata() or ())
            reason = meta.get("muser-reason", "open")
            missing = [bytes.fromhex(d) for d in meta.get("muser-missing", "").split(",") if d]
            raise RoundRefused(exc.code(), reason, exc.details() or "", missing) from exc

    def moved(self, s: ProposerSession, to: Member) -> list[bytes]:
        """Move the session to `to` at the next epoch, in memory: the request in flight
        signed again at that epoch (a result at the old one is never taken), the request
        ahead dropped (it went to the verifier left). Returns what the journal must hold
        before the session is opened there: MOVED, then the request in flight's PREPARED."""
        epoch = s.epoch + 1
        s.place(to.name, epoch)
        s.ahead = None
        records = [journal.encode_moved(s.session_id, epoch, to.name)]
        if s.prepared is not None:
            s.prepared = s.resign(s.prepared, self.private)
            records.append(journal.encode_prepared(s.session_id, s.next_round, s.prepared))
        self.pool.moved_to(to.name)
        return records

    async def move_on(self, s: ProposerSession, why: str) -> None:
        """Move the session to the next verifier of the pool (`moved`), its records durable
        before anything is sent there, and say so in the log."""
        left, to = self.home(s), self.pool.next_after(s.home)
        await self.log.append_many_async(self.moved(s, to))
        log.warning(
            "session %s round %d: moved from verifier %r to %r at epoch %d (%s)",
            s.session_id.hex()[:8], s.next_round, left.name, to.name, s.epoch, why,
        )  # fmt: skip

    async def fence(self, s: ProposerSession, left: Member) -> None:
        """Tell a verifier the session left its epoch there (an open at the session's
        epoch now), so it refuses the old one; retried until it answers, the session comes
        back to live there, or FENCE_S passed. A session that ended meanwhile is then closed
        there too. Best effort: the proposer takes results only from the verifier it lives
        on, fenced or not."""
        delay, give_up = 0.1, time.monotonic() + FENCE_S
        while s.home != left.name:
            try:
                if s.done:  # (a finished session cannot be resumed there: closed instead)
                    await self.close_remote(s, on=left, retried=True)
                else:
                    await self.open_remote(s, on=left)
            except LinkDown:
                if time.monotonic() > give_up:
                    log.warning("session %s: verifier %r was not told epoch %d in %d s; it "
                                "refuses nothing until then", s.session_id.hex()[:8], left.name,
                                s.epoch, FENCE_S)  # fmt: skip
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            except RoundRefused as exc:
                log.warning("session %s: verifier %r refused its new epoch %d: %s",
                            s.session_id.hex()[:8], left.name, s.epoch, exc)  # fmt: skip
                return
            self.pool.fences += 1
            log.info("session %s: verifier %r told epoch %d (%s)", s.session_id.hex()[:8],
                     left.name, s.epoch, "closed there" if s.done else "it refuses the epoch "
                     "before from now on")  # fmt: skip
            return

    async def close_remote(
        self, s: ProposerSession, on: Member | None = None, *, retried: bool = False
    ) -> None:
        """Tell the verifier the session is finished so it stops holding it (best effort:
        a finished session that stays open there is only answered from its WAL); or `on`,
        a verifier it left, which a close at a higher epoch closes too. `retried`: raise
        LinkDown when it does not answer (the caller tries again) and RoundRefused when it
        refuses, instead of logging."""
        request = pb.CloseSessionRequest(
            session_id=s.session_id,
            epoch=s.epoch,
            signature=self.private.sign(close_message(s.session_id, s.epoch)),
        )
        member = on or self.home(s)
        try:
            if retried:
                await member.stub.CloseSession(
                    request, wait_for_ready=True, timeout=self.pool.failover_s
                )
            else:
                await member.stub.CloseSession(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            if retried and exc.code() in RETRY_CODES:
                raise LinkDown(f"close: no answer from verifier {member.name!r}") from exc
            if retried:
                raise RoundRefused(exc.code(), "close", exc.details() or "") from exc
            log.warning(
                "session %s: closing it on the verifier failed: %s: %s",
                s.session_id.hex()[:8],
                exc.code().name,
                exc.details(),
            )

    async def attach(self, s: ProposerSession) -> RoundStream:
        await self.open_remote(s)
        stream = RoundStream(self.home(s).stub, s.session_id, s.epoch, self._count_sent)
        return await stream.attach()

    def _count_sent(self, n: int) -> None:
        self.pool.fragment_bytes += n


def fit_decode(s: ProposerSession, features) -> None:
    """A capturing session's draftless rounds decode one token on a verifier that does not
    offer `capture-decode` (an older one refuses more); else lane.decode_len.
    They end at a lookup match (`ProposerSession.lookup`) on a verifier that offers
    `lookup-stop` (an older one refuses such a round)."""
    s.lookup_offered = "lookup-stop" in features
    if s.open.capture_layers and "capture-decode" not in features:
        s.width.decode_len_max = 1
