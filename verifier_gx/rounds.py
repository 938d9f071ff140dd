"""The verifier's round transaction (docs/design.md §6, the steps drawn in verifier_gx.sessions):
admission checks under the session's lock, the round queue and its worker thread (compute,
judge, sign, then one group-committed write and fsync of the batch's ROUND records), the
fenced head CAS and the stored result a retry gets back byte for byte; and the lookahead
hint, evaluated while a round's request is still on its way.

`SessionManager` (verifier_gx.sessions) owns the sessions, their locks, the fragments and
the commit log; `Rounds` is handed it and runs rounds over them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from muser import faults, keys
from muser.backend import trees_on_held
from muser.errors import (
    EquivocationError,
    HeadMismatchError,
    JournalError,
    RoundOutOfOrderError,
    SessionFinishedError,
    UnenrolledKeyError,
)
from muser.records import RoundRequest, RoundResult, Signed, request_of, sha256
from muser.stats import VerifierStats
from muser.tasks import shielded
from verifier_gx import journal
from verifier_gx.admission import check_closure, check_decode, check_drafts, check_tree
from verifier_gx.batcher import RoundBatcher, RoundQueueFullError
from verifier_gx.compute import OnDecided, RoundComputer, RoundJob
from verifier_gx.fragments import FragmentStage
from verifier_gx.journal import short
from verifier_gx.kvpool import KvPool
from verifier_gx.replay import Replay, SessionState
from wal.errors import WalError

log = logging.getLogger("muser.verifier")


class SessionTable(Protocol):
    """What a round reads of the sessions (`verifier_gx.sessions.SessionManager` is one)."""

    replay: Replay
    fragments: FragmentStage

    @property
    def target(self): ...

    def state(self, session_id: bytes) -> SessionState: ...

    def lock(self, session_id: bytes) -> asyncio.Lock: ...

    def others_in_flight(self, session_id: bytes) -> bool: ...

    def proposer_key(self, key_id: str): ...

    def check_epoch(self, state: SessionState, epoch: int) -> None: ...

    def mark_used(self, session_id: bytes) -> None: ...


@dataclass(frozen=True)
class RoundOutcome:
    signed: bytes
    """Signed(RoundResult).encode(), byte for byte what the commit log holds."""
    result: RoundResult
    captures: list[tuple[bytes, bytes]]
    """(digest, data) capture fragments, sent before the result."""
    timings: dict[str, float]
    retry: bool


class Rounds:
    """Runs rounds over a `SessionTable`: one `RoundComputer` (the target, the signing key)
    fed by one `RoundBatcher` (limits.max_batch, limits.round_queue)."""

    def __init__(
        self,
        sessions: SessionTable,
        *,
        log,
        backend,
        kv: KvPool,
        signing_key: keys.SigningKey,
        stats: VerifierStats,
        clock: Callable[[], float],
        max_batch: int,
        max_queue: int,
        max_decode_len: int,
        max_drafts: int,
        max_tree_nodes: int = 0,
        on_target: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.sessions, self.log, self.kv, self.stats, self.clock = sessions, log, kv, stats, clock
        self.max_decode_len = max_decode_len
        """The most tokens one draftless round may ask this verifier to decode (lane.decode_len)."""
        self.max_drafts = max_drafts
        """The most drafts one round may carry (lane.draft_len_max): a round's witness rows
        are (D + 1) x vocabulary floats, so D is bounded by the lane, not by the session."""
        self.max_tree_nodes = max_tree_nodes
        """The most nodes one tree round may carry (lane.tree_nodes; 0: chains only)."""
        self.judges_trees = bool(max_tree_nodes) and hasattr(backend, "evaluate_tree")
        self.judges_trees &= kv.per_session or trees_on_held(backend)
        """Whether tree rounds are judged here (docs/design.md §3): the lane drafts trees and the
        target evaluates one on a session's own KV (torch) or on the one sequence it holds,
        a request per branch (vLLM: `trees_on_held`); another shared KV (fakes) takes chains
        only."""
        self.captures_trees = self.judges_trees and hasattr(
            backend, "evaluate_mixed_capture" if kv.per_session else "evaluate_tree_capture"
        )
        """Whether a capturing session's tree rounds are judged here: the target keeps every
        block entry's capture rows in the tree's forward (torch: in the batch's forward;
        vLLM: from the tree's requests)."""
        self.computer = RoundComputer(backend, kv, signing_key, stats, clock, on_target)
        self.batcher: RoundBatcher[RoundJob, tuple] = RoundBatcher(
            self._decide_and_commit,
            max_batch=max_batch,
            max_queue=max_queue,
            on_batch=stats.observe_batch,
            on_queue=stats.observe_queue,
        )
        self._looked_ahead: dict[bytes, int] = {}
        """Per session, the round its last lookahead ran for (one forward per round)."""

    def forget(self, session_id: bytes) -> None:
        """Drop what is held for a closed session."""
        self._looked_ahead.pop(session_id, None)

    async def run_round(self, signed: Signed, on_decided: OnDecided | None = None) -> RoundOutcome:
        """Admit, compute, commit and sign one round (docs/design.md §6). `on_decided` hears the
        decision from the worker thread as soon as it is made, before the commit."""
        return await shielded(self._round(signed, on_decided))

    async def _round(self, signed: Signed, on_decided=None) -> RoundOutcome:
        sessions = self.sessions
        request = request_of(signed)
        digest = sha256(signed.body)
        sid = request.session_id
        sessions.state(sid)
        async with sessions.lock(sid):
            state = sessions.state(sid)  # closed while we waited?
            if request.proposer_key_id != state.open.proposer_key_id:
                raise UnenrolledKeyError(
                    f"request signed by key {request.proposer_key_id!r}; session "
                    f"{short(sid)} was opened by key {state.open.proposer_key_id!r}"
                )
            public = sessions.proposer_key(request.proposer_key_id)
            keys.verify(public, signed.body, signed.signature, f"round {request.round} request")
            sessions.check_epoch(state, request.epoch)
            sessions.mark_used(sid)  # its proposer's: the session is in use
            stored = state.committed.get(request.round)
            if stored is not None:
                return self._retry(state, request, digest, stored)
            if request.round != state.next_round:
                raise RoundOutOfOrderError(
                    f"round {request.round} received; session {short(sid)} expects round "
                    f"{state.next_round}"
                )
            if request.expected_head != state.head:
                raise HeadMismatchError(
                    f"expected head {request.expected_head.hex()} received; session "
                    f"{short(sid)} is at head {state.head.hex()}"
                )
            if state.done:
                raise SessionFinishedError(
                    f"session {short(sid)} finished after {state.produced} tokens; no round "
                    f"{request.round}"
                )
            check_closure(state, request, sessions.fragments)
            vocab = sessions.target.vocab_size
            if request.is_tree:
                check_tree(state, request, vocab, self.max_tree_nodes, self.judges_trees,
                           self.captures_trees)  # fmt: skip
            else:
                check_drafts(state, request, vocab, self.max_drafts)
            check_decode(state, request, self.max_decode_len)
            faults.reached("verifier.after_closure")
            return await self._commit(state, request, digest, on_decided)

    async def look_ahead(
        self, session_id: bytes, round_: int, after: Sequence[int], drafts: Sequence[int]
    ) -> bool:
        """The proposer's Lookahead hint: once round `round_` - 1 is committed, and only if it
        emitted `after`, evaluate round `round_`, [after[-1], *drafts] after the transcript,
        before its request (`TargetExecutor.look_ahead`). Only when that is the session's
        next round, the session holds its KV (and, capturing, has been sent every row before
        the frontier: the round's rows start there), the drafts fit what is left, no other session has a round in progress (rounds go first: a lookahead holds
        the target for a whole forward, and with other sessions at work their next batch
        would wait for it), and no lookahead ran for this round yet (a hint is worth one
        forward). Never refused, never written: False when it did not run."""
        sessions = self.sessions
        if session_id not in sessions.replay.sessions or not drafts or not after:
            return False
        async with sessions.lock(session_id):  # after the round in progress, if any
            state = sessions.replay.sessions.get(session_id)  # closed while we waited?
            if (
                state is None
                or state.done
                or state.next_round != round_
                or len(after) > len(state.transcript)
                or state.transcript[-len(after) :] != [int(t) for t in after]
                or len(drafts) > max(0, state.remaining - 1)
                or (state.open.capture_layers and state.capture_from != len(state.transcript) - 1)
                or sessions.others_in_flight(session_id)
                or self._looked_ahead.get(session_id) == round_
            ):
                return False
            self._looked_ahead[session_id] = round_
            transcript, tokens = list(state.transcript), [int(d) for d in drafts]
            layers = tuple(sorted(set(state.open.capture_layers)))
            return await asyncio.to_thread(
                self.computer.look_ahead, session_id, transcript, tokens, layers
            )

    def _retry(self, state, request, digest, stored) -> RoundOutcome:
        stored_digest, stored_bytes = stored
        if stored_digest != digest:
            raise EquivocationError(
                f"round {request.round} of session {short(state.session_id)} committed request "
                f"{stored_digest.hex()}; this request is {digest.hex()}"
            )
        self.stats.retries += 1
        result = RoundResult.decode(Signed.decode(stored_bytes).body)
        captures = [
            (d, data)
            for d in result.capture_digests
            if (data := self.sessions.fragments.get(d)) is not None
        ]
        return RoundOutcome(stored_bytes, result, captures, {}, True)

    async def _commit(self, state: SessionState, request: RoundRequest, digest: bytes, on_decided):
        try:
            decided = await self.batcher.enqueue(RoundJob(state, request, digest, on_decided))
        except RoundQueueFullError:
            self.stats.queue_full += 1
            raise
        decision, result, captures, post, signed, timings = decided
        # fenced CAS: under the session lock nothing else moves head or epoch, so this holds
        if state.head != request.expected_head or state.epoch != request.epoch:
            raise JournalError(
                f"session {short(state.session_id)} moved during round {request.round}"
            )
        tokens = state.apply_round(result, digest, signed, post)
        state.capture_from = len(state.transcript) - 1  # sent up to the next frontier
        for d, data in captures:
            self.sessions.fragments.put(d, data, (state.session_id, request.round), counted=False)
        if state.done:  # a finished session only answers retries, from the log
            self.kv.drop(state.session_id)
        self._observe(request, decision, len(tokens), timings)
        log.debug(  # per round: DEBUG (at INFO its formatting alone was ~2% of a busy verifier)
            "session %s round %d: accepted %d/%d next_frontier %d emitted %d "
            "verify %.1fms wal %.1fms",
            short(state.session_id), request.round, decision.accepted, len(request.drafts),
            decision.next_frontier, len(tokens), 1e3 * timings["verify_s"], 1e3 * timings["wal_s"],
        )  # fmt: skip
        return RoundOutcome(signed, result, captures, timings, False)

    def _decide_and_commit(self, jobs: list[RoundJob]) -> list[tuple | BaseException]:
        """A batch in the worker thread (docs/design.md §6 steps 3 and 4): compute, judge and sign
        every round, then make the ROUND records of those that were decided durable in one
        write and one fsync. A commit-log failure is every decided round's failure."""
        decided = self.computer.decide(jobs)
        ok = [i for i, d in enumerate(decided) if not isinstance(d, BaseException)]
        if not ok:
            return decided
        faults.reached("verifier.after_compute")
        t0 = self.clock()
        payloads = [journal.encode(journal.RoundEntry(jobs[i].digest, decided[i][4])) for i in ok]
        try:
            self.log.append_many(payloads)
        except WalError as exc:
            for i in ok:
                decided[i] = exc
            return decided
        wal_s = self.clock() - t0
        faults.reached("verifier.after_commit_fsync")
        for i in ok:
            decided[i][5]["wal_s"] = wal_s
        return decided

    def _observe(self, request, decision, emitted: int, timings: dict[str, float]) -> None:
        self.stats.observe_round(len(request.drafts), decision.accepted, emitted, **timings)
