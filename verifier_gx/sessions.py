"""Verifier sessions: recovery from the commit log, open/resume, fencing, idle expiry and
fragment intake; the durable round transaction over them is `verifier_gx.rounds`.

One round request, in the order of docs/design.md §6 (every refusal writes nothing and leaves the
session unchanged):

  1. checks: known session, enrolled key, request signature, epoch, already committed round
     (same request digest -> the stored signed bytes; different -> equivocation), round
     index, expected head;
  2. closure: the pre-round MT state and every transcript chunk the request names is either
     what the session derives or a held, hash-checked fragment (else missing_fragments);
  3. validate the draft rows and replay the drafting draws; queue the round (bounded: a full
     queue refuses it, nothing written); the round queue (verifier_gx.batcher) runs the
     rounds waiting at the same time in one worker thread (verifier_gx.compute): witness
     rows in one target forward over each session's own KV (verifier_gx.kvpool), then per
     round judge, build the RoundResult and sign it;
  4. in that same worker thread, append the batch's ROUND records to the commit log in one
     write and one fsync (group commit), so the batch comes back to the event loop once,
     durable;
  5. fenced CAS: apply only if head and epoch are still what the request expected;
  6. return the signed bytes.

Sessions are serialised by a per-session asyncio lock; each transaction runs as a shielded
task, so a client that goes away mid-fsync cannot leave the log ahead of the state.
Recovery replays the log through `replay.Replay`; the target KV is rebuilt lazily (a
session's executor re-evaluates its transcript on first use, as after a KV eviction).

An open may carry a resume point: the last round the proposer committed, as an enrolled
verifier signed it, with the transcript and MT state after it by fragment. A verifier that
does not hold that round (a session it never saw, a lost commit log, a session that went on
at another verifier) checks it (`SessionState.resumed`), journals RESUME and goes on from it;
one that holds it re-opens the session as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from cluster_config.schema import Limits
from muser import keys
from muser.backend import ModelBackend, ModelIdentity
from muser.errors import (
    FragmentLimitError,
    FragmentMismatchError,
    FutureEpochError,
    GenesisMismatchError,
    JournalError,
    MissingFragmentsError,
    SessionClosedError,
    SessionConflictError,
    SessionLimitError,
    StaleEpochError,
    UnenrolledKeyError,
    UnknownSessionError,
)
from muser.health import Health
from muser.records import (
    RoundResult,
    SessionOpen,
    Signed,
    close_message,
    sha256,
    state_digest,
    tokens_bytes,
    tokens_from_bytes,
    transcript_chunks,
)
from muser.stats import VerifierStats
from muser.tasks import in_background, shielded
from verifier_gx import journal, replay
from verifier_gx.admission import (
    check_identities,
    check_params,
    check_qualified_capture,
    check_room,
    read_prompt,
)
from verifier_gx.compaction import LogCompactor, replay_log
from verifier_gx.compute import OnDecided
from verifier_gx.fragments import OVERHEAD, FragmentStage
from verifier_gx.journal import short
from verifier_gx.kvpool import KvPool
from verifier_gx.replay import SessionState
from verifier_gx.rounds import RoundOutcome, Rounds
from wal.errors import WalIOError
from wal.fragments import FileFragmentStore, MemoryFragmentStore

log = logging.getLogger("muser.verifier")


@dataclass(frozen=True)
class OpenRequest:
    open: SessionOpen
    epoch: int
    genesis_head: bytes
    signature: bytes
    fragments: Mapping[bytes, bytes]
    resume: bytes = b""
    """Signed(RoundResult) bytes of the proposer's last committed round; empty at genesis."""
    resume_transcript: tuple[bytes, ...] = ()
    """Digests of the transcript chunks after that round, in order (data in `fragments`)."""


@dataclass(frozen=True)
class OpenReply:
    session_id: bytes
    genesis_head: bytes
    head: bytes
    next_round: int
    epoch: int
    verifier_key_id: str
    resumed: bool = False


class SessionManager:
    def __init__(
        self,
        *,
        log,
        backend: ModelBackend,
        signing_key: keys.SigningKey,
        proposer_keys: Mapping[str, Ed25519PublicKey],
        limits: Limits,
        clock: Callable[[], float] = time.monotonic,
        qualified_draft: tuple[str, str] | None = None,
        qualified_capture: tuple[int, ...] | None = None,
        max_decode_len: int = 1,
        max_drafts: int = 64,
        max_tree_nodes: int = 0,
        verifier_keys: Mapping[str, Ed25519PublicKey] | None = None,
        compact_bytes: int = 0,
        health: Health | None = None,
        fragment_store: FileFragmentStore | MemoryFragmentStore | None = None,
    ) -> None:
        """`compact_bytes`: snapshot the commit log once this many bytes of segments piled
        up since the last snapshot, checked as sessions close (verifier.commit_compact_bytes;
        0 = never). `health` (the daemon's) is told when the target fails and recovers; its
        faults are the stats' (a manager without one keeps its own). `fragment_store`: the
        durable store behind the fragment stage (verifier_gx.fragments; None: memory only)."""
        self.log, self.backend, self.limits, self.clock = log, backend, limits, clock
        self.qualified_draft = qualified_draft
        self.qualified_capture = qualified_capture
        """The capture layers the lane's receipt qualified (None: an unqualified lane)."""
        """(model digest, tokenizer digest) of the draft the lane's receipt qualified; sessions
        opened with another draft are refused (None: not checked, e.g. unqualified tests)."""
        self.stats = VerifierStats(clock=clock)
        self.health = health
        if health is not None:
            self.stats.faults = health.faults
        self.kv = KvPool(backend, limits.kv_sessions, on_evict=self._evicted)
        self.signing_key = signing_key
        self.key_id = keys.key_id(signing_key.public_key())
        self.proposer_keys = dict(proposer_keys)
        self.verifier_keys = {**(verifier_keys or {}), self.key_id: signing_key.public_key()}
        """Enrolled verifier keys (this one's own included): a resume point signed by any of
        them is taken."""
        self.fragments = FragmentStage(fragment_store)
        self._locks: dict[bytes, asyncio.Lock] = {}
        self._open_lock = asyncio.Lock()
        self.rounds = Rounds(
            self,
            log=log,
            backend=backend,
            kv=self.kv,
            signing_key=signing_key,
            stats=self.stats,
            clock=clock,
            max_batch=limits.max_batch,
            max_queue=limits.round_queue,
            max_decode_len=max_decode_len,
            max_drafts=max_drafts,
            max_tree_nodes=max_tree_nodes,
            on_target=self._target_health,
        )
        self.replay = self._recover()
        self.compactor = LogCompactor(log, compact_bytes)
        self._seen = dict.fromkeys(self.replay.sessions, clock())
        """Per open session, when it was last opened, attached to or sent a round (`clock`;
        `close_idle`)."""

    def _evicted(self) -> None:
        self.stats.kv_evictions += 1

    def check_writable(self) -> None:
        """Refuse work up front while the commit log refuses appends (WalIOError, answered
        UNAVAILABLE: the proposer retries until a restart has recovered the log)."""
        failed = getattr(self.log, "failed", None)
        if failed is not None:
            raise WalIOError(
                f"this verifier's commit log failed and refuses appends: {failed}; "
                "restart the verifier once its disk takes writes again"
            )

    def _target_health(self, exc: BaseException | None) -> None:
        """A target forward raised (`exc`), or one ran (None): the daemon's target health."""
        if self.health is not None:
            reason = None if exc is None else f"the target backend raised {exc!r} on a forward"
            self.health.fault("target", reason)

    # ---- recovery -------------------------------------------------------------------------

    def _recover(self) -> replay.Replay:
        """The latest snapshot (verifier_gx.compaction), then every record after it."""
        try:
            return replay_log(self.log, self.verifier_keys)[0]
        except JournalError as exc:
            raise JournalError(
                f"commit log {exc}. The verifier refuses to start; check the log with "
                "`muser wal verify`"
            ) from exc

    # ---- lookups --------------------------------------------------------------------------

    @property
    def target(self) -> ModelIdentity:
        return self.backend.identity

    @property
    def num_layers(self) -> int | None:
        """Decoder layers, when the backend can capture hidden rows."""
        if not hasattr(self.backend, "evaluate_capture"):
            return None
        return getattr(self.backend, "num_layers", None)

    def state(self, session_id: bytes) -> SessionState:
        state = self.replay.sessions.get(session_id)
        if state is not None:
            return state
        if session_id in self.replay.closed:
            raise SessionClosedError(f"session {session_id.hex()} was closed")
        raise UnknownSessionError(f"no session {session_id.hex()} is open on this verifier")

    def lock(self, session_id: bytes) -> asyncio.Lock:
        """The session's lock: its opens, closes, rounds and lookaheads take turns."""
        return self._locks.setdefault(session_id, asyncio.Lock())

    def mark_used(self, session_id: bytes) -> None:
        """The session was opened, attached to or sent a round now (`close_idle`)."""
        self._seen[session_id] = self.clock()

    def others_in_flight(self, session_id: bytes) -> bool:
        """Whether another session holds its lock: a round of it admitted, queued (a round
        waits in the batcher under its session's lock) or computing, or its lookahead."""
        return any(lock.locked() for sid, lock in self._locks.items() if sid != session_id)

    def proposer_key(self, key_id: str) -> Ed25519PublicKey:
        public = self.proposer_keys.get(key_id)
        if public is None:
            raise UnenrolledKeyError(
                f"proposer key {key_id!r} is not enrolled; enrolled keys: {sorted(self.proposer_keys)}"
            )
        return public

    @staticmethod
    def check_epoch(state: SessionState, epoch: int) -> None:
        if epoch < state.epoch:
            raise StaleEpochError(
                f"epoch {epoch} is stale: session {short(state.session_id)} is at epoch "
                f"{state.epoch} (another proposer took it over)"
            )
        if epoch > state.epoch:
            raise FutureEpochError(
                f"epoch {epoch} is ahead of session {short(state.session_id)}'s epoch "
                f"{state.epoch}; open the session at that epoch first"
            )

    def attach(self, session_id: bytes, epoch: int) -> SessionState:
        state = self.state(session_id)
        self.check_epoch(state, epoch)
        self.mark_used(session_id)
        return state

    # ---- open / close ---------------------------------------------------------------------

    async def open_session(self, req: OpenRequest) -> OpenReply:
        return await shielded(self._open(req))

    async def _open(self, req: OpenRequest) -> OpenReply:
        o = req.open
        async with self._open_lock:
            public = self.proposer_key(o.proposer_key_id)
            message = o.signed_message(req.epoch, req.resume)
            keys.verify(public, message, req.signature, "session open")
            check_identities(o, self.target, self.qualified_draft)
            check_qualified_capture(o, self.qualified_capture)
            check_params(
                o,
                self.limits,
                self.target.vocab_size,
                self.num_layers,
                can_capture=hasattr(self.backend, "evaluate_capture"),
            )
            if o.genesis_head() != req.genesis_head:
                raise GenesisMismatchError(
                    f"genesis head {req.genesis_head.hex()} received, "
                    f"{o.genesis_head().hex()} recomputed from the session open"
                )
            sid = o.session_id
            if sid in self.replay.sessions:
                async with self.lock(sid):
                    state = self.replay.sessions.get(sid)  # closed while we waited?
                    if state is not None:
                        return await self._reopen(state, req)
            if sid in self.replay.closed:
                raise SessionClosedError(f"session {sid.hex()} was closed; ids are never reused")
            if req.resume:
                entry = self._resume_entry(req)
                self._check_room_for_another()
                return await self._resume(entry)
            prompt = read_prompt(o, self.lookup(req), self.target.vocab_size)
            check_room(len(prompt), o.params, self.backend.geometry.context_length)
            self._check_room_for_another()
            entry = journal.OpenEntry(o, req.epoch, tuple(prompt), req.signature)
            await self.log.append_async(journal.encode(entry))
            state = self.replay.apply(entry)
            log.info("session %s opened epoch=%d prompt=%d", short(sid), req.epoch, len(prompt))
            return self._reply(state)

    def _check_room_for_another(self) -> None:
        active = sum(1 for st in self.replay.sessions.values() if not st.done)
        if active >= self.limits.max_sessions:  # finished ones only answer retries
            raise SessionLimitError(
                f"{active} unfinished sessions are open; limits.max_sessions is "
                f"{self.limits.max_sessions}"
            )

    def _resume_entry(self, req: OpenRequest) -> journal.ResumeEntry:
        """The RESUME entry `req` asks for, every part of it checked (nothing written)."""
        o, lookup = req.open, self.lookup(req)
        point = replay.resume_point(o, req.epoch, req.resume, self.verifier_keys)
        named = [o.prompt_digest, *req.resume_transcript, point.post_state_digest]
        held = {d: lookup(d) for d in named}
        missing = [d for d, data in held.items() if data is None]
        if missing:  # every one named at once: the proposer sends them in one more open
            raise MissingFragmentsError(
                f"the open's prompt, resume transcript and MT state name {len(missing)} "
                f"fragment(s) neither in the open nor held: {[d.hex()[:16] for d in missing]}",
                missing,
            )
        prompt = read_prompt(o, held.get, self.target.vocab_size)
        check_room(len(prompt), o.params, self.backend.geometry.context_length)
        chunks = [held[d] for d in req.resume_transcript]
        if any(not chunk or len(chunk) % 4 for chunk in chunks):
            raise FragmentMismatchError(
                "a resume transcript chunk is not a non-empty whole number of u32 token ids"
            )
        transcript = [t for chunk in chunks for t in tokens_from_bytes(chunk)]
        if transcript[: len(prompt)] != prompt or len(transcript) <= len(prompt):
            raise FragmentMismatchError(
                f"the resume transcript ({len(transcript)} tokens) does not extend the "
                f"session's prompt ({len(prompt)} tokens)"
            )
        entry = journal.ResumeEntry(
            o,
            req.epoch,
            tuple(prompt),
            req.signature,
            req.resume,
            held[point.post_state_digest],
            tuple(transcript[len(prompt) :]),
        )
        replay.SessionState.resumed(entry, self.verifier_keys)  # raises what does not fit
        return entry

    async def _resume(self, entry: journal.ResumeEntry) -> OpenReply:
        await self.log.append_async(journal.encode(entry))
        state = self.replay.apply(entry)
        self.kv.drop(state.session_id)  # a KV this verifier held is of another transcript
        self.stats.resumes += 1
        log.info(
            "session %s resumed after round %d (signed by verifier %s) epoch=%d transcript=%d",
            short(state.session_id), state.next_round - 1,
            RoundResult.decode(Signed.decode(entry.resume).body).verifier_key_id,
            entry.epoch, len(state.transcript),
        )  # fmt: skip
        return self._reply(state, resumed=True)

    async def _reopen(self, state: SessionState, req: OpenRequest) -> OpenReply:
        if state.open.encode() != req.open.encode():
            raise SessionConflictError(
                f"session {state.session_id.hex()} is open with genesis head "
                f"{state.open.genesis_head().hex()}; this open has {req.genesis_head.hex()}"
            )
        if req.epoch < state.epoch:
            self.check_epoch(state, req.epoch)
        if req.resume and not self._holds(state, req.resume):
            # behind the proposer, or gone on differently (rounds it never committed):
            # the session moves to the round the proposer committed
            return await self._resume(self._resume_entry(req))
        if req.epoch > state.epoch:
            entry = journal.EpochEntry(state.session_id, req.epoch)
            await self.log.append_async(journal.encode(entry))
            self.replay.apply(entry)
            log.info("session %s fenced at epoch %d", short(state.session_id), req.epoch)
        return self._reply(state)

    @staticmethod
    def _holds(state: SessionState, resume: bytes) -> bool:
        """The session committed exactly this signed round (it is at it or one past it)."""
        point = RoundResult.decode(Signed.decode(resume).body)
        return state.committed.get(point.round) == (point.request_digest, resume)

    def _reply(self, state: SessionState, resumed: bool = False) -> OpenReply:
        """The answer to an open (new, again or resumed): the session is in use, and its next
        round's capture rows start from position 0 (the proposer may have lost them)."""
        self.mark_used(state.session_id)
        state.capture_from = 0
        return OpenReply(
            state.session_id,
            state.open.genesis_head(),
            state.head,
            state.next_round,
            state.epoch,
            self.key_id,
            resumed,
        )

    async def close_session(self, session_id: bytes, epoch: int, signature: bytes) -> None:
        if session_id in self.replay.closed:
            return  # closing twice is a no-op
        await shielded(self._close(session_id, epoch, signature))

    async def _close(self, session_id: bytes, epoch: int, signature: bytes) -> None:
        self.state(session_id)  # an unknown session is refused before any wait
        async with self.lock(session_id):
            if session_id in self.replay.closed:
                return  # closed while we waited: as closing twice
            # read under the lock: a resume while we waited replaces the state (new epoch)
            state = self.state(session_id)
            public = self.proposer_key(state.open.proposer_key_id)
            keys.verify(public, close_message(session_id, epoch), signature, "close")
            if epoch < state.epoch:
                self.check_epoch(state, epoch)
            # (a higher epoch: the session moved on to another verifier of its proposer's
            # pool and ended there; its proposer closes it here, for good)
            await self._journal_close(session_id)
            log.info("session %s closed after %d rounds", short(session_id), state.next_round)
        self._tidy()

    def _tidy(self) -> None:
        """After sessions closed: compact the commit log if due, collect stored fragments."""
        in_background(self.compactor.maybe_compact(), "commit log compaction", log)
        in_background(self.collect_fragments(), "fragment collection", log)

    async def _journal_close(self, session_id: bytes) -> None:
        """Journal a session's CLOSE; once durable, apply it and drop all held for it."""
        await self.log.append_async(journal.encode(journal.CloseEntry(session_id)))
        self.replay.apply(journal.CloseEntry(session_id))
        self.fragments.drop_session(session_id)
        self.kv.drop(session_id)
        self._locks.pop(session_id, None)
        self.rounds.forget(session_id)
        self._seen.pop(session_id, None)

    def _in_progress(self, session_id: bytes) -> bool:
        """True while a request of the session holds its lock (a round being served)."""
        lock = self._locks.get(session_id)
        return lock is not None and lock.locked()

    async def close_idle(self) -> list[bytes]:
        """Close every session idle for `limits.session_idle_s`: nothing opened, attached
        to or sent a round for it meanwhile, and no round of it in progress. Its proposer is
        gone for good (a live one drives its rounds back to back) or finished it without
        closing it. Returns the ids closed."""
        idle_s = self.limits.session_idle_s
        stale = [
            sid
            for sid, seen in self._seen.items()
            if idle_s and self.clock() - seen >= idle_s and not self._in_progress(sid)
        ]
        closed = [sid for sid in stale if await shielded(self._close_if_idle(sid, idle_s))]
        if closed:
            self._tidy()
        return closed

    async def _close_if_idle(self, sid: bytes, idle_s: float) -> bool:
        """Close `sid` if it is still idle once its lock is free. Run shielded (`shielded`):
        a cancelled sweep must not leave a CLOSE durable and unapplied, with the lock free."""
        if sid not in self.replay.sessions:
            return False  # closed meanwhile (its lock is gone: do not make another)
        async with self.lock(sid):
            seen = self._seen.get(sid)
            if seen is None or self.clock() - seen < idle_s:
                return False  # closed or used while we waited
            state = self.replay.sessions[sid]
            await self._journal_close(sid)
        self.stats.idle_closed += 1
        log.info(
            "session %s closed: idle for %.0f s (limits.session_idle_s) after %d rounds",
            short(sid), self.clock() - seen, state.next_round,
        )  # fmt: skip
        return True

    async def expire_idle(self) -> None:
        """`close_idle` every quarter of `limits.session_idle_s` (at least once a minute),
        until cancelled; returns at once when it is 0."""
        idle_s = self.limits.session_idle_s
        while idle_s:
            await asyncio.sleep(min(idle_s / 4, 60.0))
            try:
                await self.close_idle()
            except Exception as exc:  # the commit log failed: its appends refuse from now on
                log.error("closing idle sessions failed: %s", exc)

    # ---- fragments ------------------------------------------------------------------------

    def lookup(self, req: OpenRequest) -> Callable[[bytes], bytes | None]:
        """Where an open's named fragments are found: the open's own (hash-checked, and kept
        in the durable store), then the stage and the store, then what this verifier derives
        from its own state of the session (its prompt, its transcript's chunks, its MT
        state: a session coming back from another verifier resends only what it lacks)."""
        for digest, data in req.fragments.items():
            FragmentStage.check(digest, data)
            self._keep(data)
        derived: dict[bytes, bytes] = {}
        state = self.replay.sessions.get(req.open.session_id)
        if state is not None:
            derived = {sha256(c): c for c in transcript_chunks(state.transcript)}
            derived[state_digest(state.mt)] = state.mt.to_bytes()
            derived[state.open.prompt_digest] = tokens_bytes(state.prompt)

        def held(digest: bytes) -> bytes | None:
            for found in (req.fragments.get(digest), derived.get(digest)):
                if found is not None:
                    return found
            return self.fragments.get(digest)

        return held

    def _keep(self, data: bytes) -> None:
        """Write a fragment a proposer sent to the durable store, off the event loop."""
        if self.fragments.store is not None:
            in_background(asyncio.to_thread(self.fragments.keep, data), "fragment store", log)

    async def collect_fragments(self) -> int:
        """Drop stored fragments no open session's committed records name and nothing
        stages, once past the store's grace period; returns how many went."""
        if self.fragments.store is None:
            return 0
        named: list[bytes] = []
        for state in self.replay.sessions.values():
            named.append(state.open.prompt_digest)
            named += [sha256(c) for c in transcript_chunks(state.transcript)]
            named.append(state_digest(state.mt))
        return await asyncio.to_thread(self.fragments.store.gc, self.fragments.live(named))

    def put_fragment(self, session_id: bytes, digest: bytes, data: bytes) -> None:
        """Stage a fragment the proposer sent, up to limits.max_message_bytes a session
        holds unacknowledged (each charged OVERHEAD more): enough for any transcript, and no
        unbounded memory for fragments nothing names."""
        state = self.state(session_id)
        cap, held = self.limits.max_message_bytes, self.fragments.held_by(session_id)
        if self.fragments.get(digest) is None and held + len(data) + OVERHEAD > cap:
            raise FragmentLimitError(
                f"session {short(session_id)} has {held} bytes of fragments staged and not "
                f"acknowledged; {len(data)} more would pass limits.max_message_bytes = {cap}"
            )
        if self.fragments.put(digest, data, (session_id, state.next_round)):
            self._keep(data)

    def ack(self, session_id: bytes, round_: int) -> int:
        return self.fragments.release(session_id, round_)

    # ---- the round transaction (verifier_gx.rounds) ---------------------------------------

    async def run_round(self, signed: Signed, on_decided: OnDecided | None = None) -> RoundOutcome:
        """Admit, compute, commit and sign one round (docs/design.md §6; `Rounds.run_round`)."""
        return await self.rounds.run_round(signed, on_decided)

    async def look_ahead(
        self, session_id: bytes, round_: int, after: Sequence[int], drafts: Sequence[int]
    ) -> bool:
        """The proposer's Lookahead hint (`Rounds.look_ahead`)."""
        return await self.rounds.look_ahead(session_id, round_, after, drafts)
