"""The gRPC edge of the verifier: `muser.v2.Verifier` over grpc.aio.

Wire types stay here: requests are converted to plain records (muser.wire.convert), the
session manager does the work, and each domain error maps to exactly one status code and
machine-readable reason (`STATUS`). Unary RPCs abort with that status (reason and missing
digests ride in trailing metadata `muser-reason` / `muser-missing`); on the Rounds stream
a refused request is answered in band with a RoundError and the stream stays open.

Rounds: the first message must be Attach{session_id, epoch}. Then
  RoundRequest -> a Decision as soon as the round is decided (unsigned, before its commit: a
                  hint), capture Fragments (if any), then one RoundResult; or one RoundError
  Fragment     -> staged (duplicates and reordering absorbed); a hash mismatch -> RoundError
  Ack          -> releases the fragments staged for rounds <= that round
  Lookahead    -> never answered: may evaluate the round it names before its request
The stream is read while a round is in progress: a Lookahead starts when it arrives (it may
run the moment the round in progress commits); the other messages are handled in order.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from muser import faults, logs
from muser.affinity import pinned_to
from muser.canonical import CanonicalError
from muser.errors import (
    CaptureLayerError,
    ContextOverflowError,
    DecodeLengthError,
    DraftMismatchError,
    DraftOverrunError,
    DraftZeroProbabilityError,
    EquivocationError,
    FragmentHashMismatchError,
    FragmentLimitError,
    FragmentMismatchError,
    FrontierMismatchError,
    FutureEpochError,
    GenesisMismatchError,
    HeadMismatchError,
    InvalidPromptError,
    InvalidSamplingParamsError,
    InvalidWeightsError,
    JournalError,
    LookupRuleError,
    MissingFragmentsError,
    ModelMismatchError,
    MuserError,
    NotAttachedError,
    RefusedError,
    ResumeMismatchError,
    RoundOutOfOrderError,
    RowCountError,
    RowWidthError,
    SessionClosedError,
    SessionConflictError,
    SessionFinishedError,
    SessionLimitError,
    StaleEpochError,
    TokenOutOfVocabularyError,
    TreeTopologyError,
    TreeUnsupportedError,
    UnenrolledKeyError,
    UnknownSessionError,
)
from muser.keys import SignatureError
from muser.metrics import DaemonView, status_fields
from muser.records import Signed
from muser.tasks import in_background
from muser.tree import TreeDecision
from muser.verify import RoundDecision
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from muser.wire import muser_v2_pb2_grpc as pb_grpc
from verifier_gx.batcher import RoundQueueFullError
from verifier_gx.fragments import FragmentStage
from verifier_gx.journal import short
from verifier_gx.sessions import OpenRequest, SessionManager
from wal.errors import WalError

log = logging.getLogger("muser.verifier")
C = grpc.StatusCode

STATUS: dict[type[BaseException], tuple[grpc.StatusCode, str]] = {
    UnknownSessionError: (C.NOT_FOUND, "unknown_session"),
    SessionClosedError: (C.FAILED_PRECONDITION, "session_closed"),
    SessionConflictError: (C.ALREADY_EXISTS, "session_conflict"),
    SessionLimitError: (C.RESOURCE_EXHAUSTED, "max_sessions"),
    RoundQueueFullError: (C.RESOURCE_EXHAUSTED, "round_queue_full"),
    SessionFinishedError: (C.FAILED_PRECONDITION, "session_finished"),
    UnenrolledKeyError: (C.PERMISSION_DENIED, "unenrolled_key"),
    SignatureError: (C.UNAUTHENTICATED, "bad_signature"),
    StaleEpochError: (C.ABORTED, "stale_epoch"),
    FutureEpochError: (C.FAILED_PRECONDITION, "future_epoch"),
    EquivocationError: (C.ALREADY_EXISTS, "equivocation"),
    RoundOutOfOrderError: (C.FAILED_PRECONDITION, "round_out_of_order"),
    HeadMismatchError: (C.ABORTED, "head_mismatch"),
    GenesisMismatchError: (C.INVALID_ARGUMENT, "genesis_mismatch"),
    ResumeMismatchError: (C.INVALID_ARGUMENT, "resume_mismatch"),
    FrontierMismatchError: (C.FAILED_PRECONDITION, "frontier_mismatch"),
    MissingFragmentsError: (C.FAILED_PRECONDITION, "missing_fragments"),
    FragmentHashMismatchError: (C.DATA_LOSS, "fragment_hash_mismatch"),
    FragmentLimitError: (C.RESOURCE_EXHAUSTED, "fragments_full"),
    FragmentMismatchError: (C.FAILED_PRECONDITION, "fragment_mismatch"),
    RowCountError: (C.INVALID_ARGUMENT, "row_count"),
    RowWidthError: (C.INTERNAL, "row_width"),  # witness rows come from our own backend
    TokenOutOfVocabularyError: (C.INVALID_ARGUMENT, "token_out_of_vocabulary"),
    InvalidWeightsError: (C.INVALID_ARGUMENT, "invalid_weights"),
    DraftZeroProbabilityError: (C.INVALID_ARGUMENT, "draft_zero_probability"),
    DraftOverrunError: (C.INVALID_ARGUMENT, "too_many_drafts"),
    DecodeLengthError: (C.INVALID_ARGUMENT, "decode_len"),
    LookupRuleError: (C.INVALID_ARGUMENT, "lookup_rule"),
    DraftMismatchError: (C.FAILED_PRECONDITION, "draft_mismatch"),
    TreeTopologyError: (C.INVALID_ARGUMENT, "malformed_tree"),
    TreeUnsupportedError: (C.FAILED_PRECONDITION, "tree_rounds_unsupported"),
    InvalidSamplingParamsError: (C.INVALID_ARGUMENT, "invalid_params"),
    InvalidPromptError: (C.INVALID_ARGUMENT, "invalid_prompt"),
    CaptureLayerError: (C.INVALID_ARGUMENT, "capture_layer"),
    ModelMismatchError: (C.FAILED_PRECONDITION, "identity_mismatch"),
    ContextOverflowError: (C.OUT_OF_RANGE, "context_overflow"),
    CanonicalError: (C.INVALID_ARGUMENT, "malformed"),
    NotAttachedError: (C.INVALID_ARGUMENT, "not_attached"),
    JournalError: (C.INTERNAL, "journal"),
    WalError: (C.UNAVAILABLE, "wal_failure"),  # retried: sessions resume after a restart
    RefusedError: (C.INVALID_ARGUMENT, "refused"),
    MuserError: (C.INTERNAL, "internal"),
}


INBOX = 64
"""Messages of one Rounds stream read ahead of the round in progress (`_read`)."""
HINTS = 8
"""Lookahead hints of one Rounds stream waiting at once; more are dropped (hints only)."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and reason of the most specific class in the table."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return C.UNKNOWN, "unexpected"


HASH_ON_LOOP_BYTES = 64 * 1024
"""Fragments up to this many bytes in all are hashed on the event loop; more in a worker
thread (SHA-256 of 8 MB takes ~20 ms, and hashlib lets the loop run meanwhile)."""


async def check_fragments(fragments) -> None:
    """Every fragment hashes to its digest (FragmentStage.check), off the loop when big."""

    def check_all() -> None:
        for f in fragments:
            FragmentStage.check(f.digest, f.data)

    if sum(len(f.data) for f in fragments) <= HASH_ON_LOOP_BYTES:
        check_all()
    else:
        await asyncio.to_thread(check_all)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(
        self, manager: SessionManager, *, on_fatal: Callable[[BaseException], None] | None = None
    ) -> None:
        self.manager = manager
        self.on_fatal = on_fatal

    def _refused(self, exc: BaseException, where: str) -> tuple[grpc.StatusCode, str]:
        code, reason = status_for(exc)
        self.manager.stats.observe_refusal(reason, code.name)
        log.warning("%s refused: %s %s: %s", where, code.name, reason, exc)
        if isinstance(exc, WalError) and self.on_fatal is not None:
            self.on_fatal(exc)
        return code, reason

    async def _abort(self, context, exc: BaseException, where: str) -> None:
        code, reason = self._refused(exc, where)
        metadata = [("muser-reason", reason)]
        if isinstance(exc, MissingFragmentsError):
            metadata.append(("muser-missing", ",".join(d.hex() for d in exc.missing)))
        await context.abort(code, f"{reason}: {exc}", trailing_metadata=tuple(metadata))

    # ---- unary ----------------------------------------------------------------------------

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        try:
            self.manager.check_writable()
            await check_fragments(request.fragments)
            req = OpenRequest(
                convert.open_from_pb(request),
                request.epoch,
                request.genesis_head,
                request.signature,
                {f.digest: f.data for f in request.fragments},
                request.resume,
                tuple(request.resume_transcript),
            )
            reply = await self.manager.open_session(req)
        except MuserError as exc:
            await self._abort(context, exc, f"open {request.session_id.hex()[:8]}")
        return pb.OpenSessionResponse(
            session_id=reply.session_id,
            genesis_head=reply.genesis_head,
            head=reply.head,
            next_round=reply.next_round,
            epoch=reply.epoch,
            verifier_key_id=reply.verifier_key_id,
            resumed=reply.resumed,
            features=[
                *(["tree-rounds"] if self.manager.rounds.judges_trees else []),
                "capture-decode",
                "lookup-stop",
                *(["capture-trees"] if self.manager.rounds.captures_trees else []),
            ],  # fmt: skip
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context
    ) -> pb.CloseSessionResponse:
        try:
            await self.manager.close_session(request.session_id, request.epoch, request.signature)
        except MuserError as exc:
            await self._abort(context, exc, f"close {request.session_id.hex()[:8]}")
        return pb.CloseSessionResponse()

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        data = status_json(self.manager)
        return pb.StatusResponse(
            role="verifier",
            key_id=self.manager.key_id,
            sessions=data["sessions"],
            json=json.dumps(data, sort_keys=True),
        )

    # ---- the round stream -----------------------------------------------------------------

    async def Rounds(self, request_iterator, context) -> AsyncIterator[pb.VerifierMessage]:
        messages = aiter(request_iterator)
        try:
            msg = await anext(messages)
        except StopAsyncIteration:
            return
        except DecodeError as exc:  # gRPC parses a stream's messages as they are read
            bad = CanonicalError(f"the first message of the stream is not a ProposerMessage: {exc}")
            await self._abort(context, bad, "attach")
        kind = msg.WhichOneof("kind")
        try:
            if kind != "attach":
                raise NotAttachedError(
                    f"the first message of a Rounds stream must be Attach, got {kind}"
                )
            self.manager.attach(msg.attach.session_id, msg.attach.epoch)
        except MuserError as exc:
            await self._abort(context, exc, f"attach {msg.attach.session_id.hex()[:8]}")
        session_id = msg.attach.session_id
        inbox: asyncio.Queue = asyncio.Queue(maxsize=INBOX)
        reader = asyncio.ensure_future(self._read(session_id, messages, inbox))
        try:
            while (msg := await inbox.get()) is not None:
                if isinstance(msg, DecodeError):  # a message that does not parse
                    where = f"session {session_id.hex()[:8]}"
                    bad = CanonicalError(f"a message of the stream is not a ProposerMessage: {msg}")
                    await self._abort(context, bad, where)
                if isinstance(msg, BaseException):  # the request stream failed
                    raise msg
                async for out in self._in_order(session_id, msg):
                    yield out
        finally:
            reader.cancel()

    async def _read(self, session_id: bytes, messages, inbox: asyncio.Queue) -> None:
        """Read the stream while a round is in progress: a Lookahead hint starts at once (it
        waits for the round in progress and may run the moment that round commits, not after
        its result is out); every other message goes to `inbox` in order (a bounded queue: a
        client that sends faster than rounds run waits, as it did on the stream). None ends
        the inbox; an exception of the stream is put there to be raised."""
        hints: set[asyncio.Future] = set()
        try:
            async for msg in messages:
                if msg.WhichOneof("kind") != "lookahead":
                    await inbox.put(msg)
                elif len(hints) < HINTS:  # a hint is never answered, and one too many is dropped
                    ahead = msg.lookahead
                    hint = self.manager.look_ahead(
                        session_id, ahead.round, list(ahead.after), list(ahead.drafts)
                    )
                    task = in_background(hint, "a lookahead", log)
                    hints.add(task)
                    task.add_done_callback(hints.discard)
        except Exception as exc:
            await inbox.put(exc)
        await inbox.put(None)

    async def _in_order(self, session_id: bytes, msg: pb.ProposerMessage):
        """The messages a message of the attached stream is answered with (a request's as its
        round goes)."""
        kind = msg.WhichOneof("kind")
        if kind == "request":
            async for out in self._round_messages(session_id, msg.request):
                yield out
        elif kind == "fragment":
            error = self._fragment(session_id, msg.fragment)
            if error is not None:
                yield error
        elif kind == "ack":
            if msg.ack.session_id == session_id:
                self.manager.ack(session_id, msg.ack.round)
                faults.reached("verifier.after_ack")
            else:
                exc = NotAttachedError(
                    f"ack for session {msg.ack.session_id.hex()}; this stream is attached "
                    f"to {session_id.hex()}"
                )
                yield self._error(msg.ack.round, exc, "ack")
        else:
            exc = NotAttachedError(f"{kind} after Attach; this stream is already attached")
            yield self._error(0, exc, f"session {short(session_id)}")

    def _error(self, round_: int, exc: BaseException, where: str) -> pb.VerifierMessage:
        code, reason = self._refused(exc, where)
        missing = exc.missing if isinstance(exc, MissingFragmentsError) else []
        return pb.VerifierMessage(
            error=pb.RoundError(
                round=round_, code=code.value[0], reason=reason, message=str(exc), missing=missing
            )
        )

    async def _round_messages(self, session_id: bytes, request: pb.RoundRequest):
        """A round's messages as they come: its early decision (a hint the proposer may start
        its next draft on, sent before the round's commit), then its capture fragments and
        signed result, or its refusal."""
        loop = asyncio.get_running_loop()
        early: asyncio.Queue = asyncio.Queue()

        def decided(d: RoundDecision | TreeDecision, capture_digests: tuple[bytes, ...]) -> None:
            tree = isinstance(d, TreeDecision)  # (in the worker thread)
            msg = pb.VerifierMessage(
                decision=pb.Decision(
                    round=request.round,
                    accepted=d.accepted,
                    next_frontier=d.next_frontier,
                    decoded=[] if tree else list(d.decoded),
                    capture_digests=list(capture_digests),
                    path=list(d.path) if tree else [],
                )
            )
            loop.call_soon_threadsafe(early.put_nowait, msg)

        with logs.round_scope(request.session_id, request.round):  # the task's log lines
            task = asyncio.ensure_future(self._round(session_id, request, decided))
        # the decision is queued before the round can finish (it is told before the commit)
        task.add_done_callback(lambda _: early.put_nowait(None))
        while (msg := await early.get()) is not None:
            yield msg
        for msg in task.result():
            yield msg
            if msg.WhichOneof("kind") == "result":
                faults.reached("verifier.after_emit")

    async def _round(self, session_id: bytes, request: pb.RoundRequest, on_decided=None) -> list:
        where = f"session {request.session_id.hex()[:8]} round {request.round}"
        try:
            if request.session_id != session_id:
                raise NotAttachedError(
                    f"request for session {request.session_id.hex()}; this stream is attached "
                    f"to {session_id.hex()}"
                )
            self.manager.check_writable()
            signed = convert.request_from_pb(request)
            outcome = await self.manager.run_round(signed, on_decided)
        except MuserError as exc:
            return [self._error(request.round, exc, where)]
        except Exception as exc:  # a fault of ours (the backend, a bug): this round's alone
            log.error("%s failed", where, exc_info=exc)
            failure = MuserError(f"the verifier failed computing the round: {exc!r}")
            return [self._error(request.round, failure, where)]
        out = [
            pb.VerifierMessage(fragment=pb.Fragment(digest=d, data=data))
            for d, data in outcome.captures
        ]
        signed = Signed.decode(outcome.signed)  # outcome.result is what its body encodes
        result = convert.result_to_pb(Signed(signed.body, signed.signature, outcome.result),
                                      outcome.timings)  # fmt: skip
        out.append(pb.VerifierMessage(result=result))
        if outcome.retry:
            log.info("%s: retry answered with the committed result", where)
        return out

    def _fragment(self, session_id: bytes, fragment: pb.Fragment) -> pb.VerifierMessage | None:
        try:
            self.manager.put_fragment(session_id, fragment.digest, fragment.data)
        except MuserError as exc:
            state = self.manager.replay.sessions.get(session_id)
            round_ = state.next_round if state is not None else 0
            return self._error(round_, exc, f"session {short(session_id)} fragment")
        return None


def metrics_view(manager: SessionManager) -> DaemonView:
    """The verifier's stats as `muser.metrics` exports them (`/metrics`, Status)."""
    states = manager.replay.sessions.values()
    return DaemonView(
        role="verifier",
        key_id=manager.key_id,
        lane=manager.stats,
        daemon=manager.stats,
        sessions=len(states),
        open_sessions=sum(1 for st in states if not st.done),
        wal_dir=getattr(manager.log, "directory", None),
        now=manager.stats.clock(),
        retries=manager.stats.retries,
        verifier=manager.stats,
        round_queue=manager.rounds.batcher.depth,
        kv_sessions=len(manager.kv),
    )


def _device_label(backend) -> str:
    """Where the target computes ("torch:cuda"), or at least its device, for `muser status`."""
    return getattr(backend, "device_label", None) or getattr(backend, "device", None) or "unknown"


def status_json(manager: SessionManager) -> dict:
    """The verifier's status: sessions, throughput, the verifier-only ceiling, the WAL."""
    s = manager.stats
    states = list(manager.replay.sessions.values())
    common = status_fields(metrics_view(manager))
    common["wal"]["last_seq"] = manager.log.last_seq
    common["wal"]["append_max_s"] = s.wal_max_s if s.rounds else None
    t = manager.target
    return {
        "role": "verifier",
        "key_id": manager.key_id,
        **common,
        "closed_sessions": len(manager.replay.closed),
        "idle_closed": s.idle_closed,
        "snapshot_seq": getattr(manager.log.latest_snapshot(), "seq", None),
        "committed_rounds": sum(st.next_round for st in states),
        "retries": s.retries,
        "resumes": s.resumes,
        "verify_s": s.verify_s,
        "sign_s": s.sign_s,
        "fragments": {
            "held": len(manager.fragments),
            "bytes": manager.fragments.bytes_held,
            "stored": manager.fragments.stored,
        },
        "batching": {
            "batches": s.batches,
            "mean_batch": s.mean_batch,
            "batch_sizes": {str(k): n for k, n in sorted(s.batch_sizes.items())},
            "max_batch": manager.limits.max_batch,
            "queue_depth": manager.rounds.batcher.depth,
            "queue_depth_max": s.queue_depth_max,
            "round_queue": manager.limits.round_queue,
            "queue_full": s.queue_full,
        },
        "kv": {
            "per_session": manager.kv.per_session,
            "sessions": len(manager.kv),
            "kv_sessions": manager.limits.kv_sessions,
            "evictions": manager.kv.evictions,
            "rebuilt_tokens": s.kv_rebuilt_tokens,
        },
        "lookahead": {"rounds": s.lookaheads, "hits": s.lookahead_hits, "s": s.lookahead_s},
        "target": {
            "model_digest": t.model_digest,
            "tokenizer_digest": t.tokenizer_digest,
            "vocab_size": t.vocab_size,
            "context_length": manager.backend.geometry.context_length,
            "device": _device_label(manager.backend),
            # torch: "lean" (the lean Llama forward) or "transformers"; absent for others
            "forward": getattr(manager.backend, "forward_kind", None),
        },
        "cpus": pinned_to(),  # the CPUs verifier.cpus (or a cpuset) confines it to
    }
