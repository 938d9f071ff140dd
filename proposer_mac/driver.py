"""The round driver: one task per session, drafting, journaling and committing rounds.

Per round (docs/design.md §6, the proposer's steps):
  1. draft (in the single draft thread, `DraftQueue`: rounds of several sessions waiting there
     together are drafted in lockstep, one batched forward per draft step);
  2. PREPARED(session, r, signed request) appended and fsynced;
  3. send; on `LinkDown` reconnect with backoff and re-send the same bytes;
  4. check the signed result (enrolled verifier key, head chain, MT state, transcript);
  5. COMMITTED appended and fsynced; only then are the tokens handed to clients;
  6. ack, once the next request is on the wire (or the session ends).

Step 5 of round r and step 2 of round r+1 are one write and one fsync: COMMITTED(r) waits
for the next draft and goes to the log with PREPARED(r+1), in that order (with DONE when
the session ends there). Both sit on the path from one result to the next request, where
two appends cost two fsyncs and their thread hand-offs on the proposer's core; one costs
one. What can be lost to a crash is unchanged: a result whose COMMITTED is not durable is
asked for again by re-sending PREPARED(r), which the verifier answers from its WAL byte for
byte. Clients see round r's tokens once the next draft is ready (at once when it was
drafted ahead, which is most rounds).

Drafting ahead (lane.speculate) is `proposer_mac.ahead.DraftingAhead`; sending on the
decision (lane.send_on_decision) is `proposer_mac.send_ahead.SendAhead`; this module runs
the loop that uses both. Sending on the decision: the verifier tells round r's
decision before its commit and signed result, and every digest of that result but the
signature is the proposer's own to compute (`ProposerSession.predict`), the head it chains
to included. So once the next draft on that decision is ready, round r+1's request is built
on that head, journaled (PREPARED r+1, before COMMITTED r) and sent while the verifier still
commits and signs r; the verifier takes it right after r. Only a draft already made when the
decision comes goes ahead: one begun on the decision takes longer than the result does to
follow it, so it would gain nothing and cost the prediction and a second fsync. When r's
signed result arrives and checks, COMMITTED r is written alone and r+1 is already in flight;
the round after r+1 has been drafting since r+1 was sent. The guarantees stay:
PREPARED r+1 is durable before its request leaves, COMMITTED r before r's tokens reach
clients and before the ack of r, and what r emits is only ever what its signed result says.
A result that differs from its decision (a verifier that recomputed r after a restart, or a
faulty one) voids the request sent ahead: its head is not the verifier's, so the fenced head
check refuses it and nothing is written there; the driver drops that stream (it carries the
refusal), drafts r+1 again, and its PREPARED takes the void one's place in the journal
(`journal.replay`). A restart between PREPARED r+1 and COMMITTED r re-sends r, then r+1
once r's result carries the head it expects.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

from muser import faults, logs
from muser.capture import result_rows
from muser.errors import RefusedError
from muser.records import Signed
from muser.stats import LaneStats
from muser.tasks import in_background
from muser.tree import tree_depth
from muser.wire import muser_v2_pb2 as pb
from proposer_mac import journal
from proposer_mac.ahead import DraftingAhead, look_ahead, told_emission
from proposer_mac.context import DriverContext
from proposer_mac.drafting import Draft, Drafter
from proposer_mac.link import LinkDown, RoundRefused, RoundStream, fenced
from proposer_mac.send_ahead import SendAhead
from proposer_mac.session import ProposerSession, ResultRejected, SessionFailed
from proposer_mac.speculating import Speculating

log = logging.getLogger("muser.proposer")

QUEUE_FULL = "round_queue_full"
"""The refusal reason of a verifier whose round queue is full: re-send after a backoff."""


class SessionRunner:
    """Drives one session to completion and lets clients wait for its tokens."""

    def __init__(
        self,
        session: ProposerSession,
        drafter: Drafter,
        core: DriverContext,
        *,
        owns_draft_kv: bool = False,
    ):
        self.session, self.drafter, self.core = session, drafter, core
        self.owns_draft_kv = owns_draft_kv
        """The drafter's backend is this session's own fork: its KV is dropped at the end."""
        self.stats = LaneStats()
        self.changed = asyncio.Condition()
        self.error: Exception | None = None
        self.task: asyncio.Task | None = None
        self.durable = len(session.emitted)
        """Tokens whose COMMITTED entry is durable: the only ones clients may see."""
        self.cancelled = False
        """Set by `cancel`: the session ends after the round in flight."""
        self.detached = False
        """Its client cannot reconnect (an HTTP request): a restart ends it (journal.DETACHED)."""
        self.ahead = DraftingAhead(session, drafter, core, self.stats, self._start_draft)
        """The next round drafted while this one is at the verifier (proposer_mac.ahead)."""
        self.send_ahead = SendAhead(session, core, self.stats, self.ahead)
        """The next request sent on this round's decision (proposer_mac.send_ahead)."""

    def start(self) -> None:
        self.task = asyncio.create_task(
            self._run(), name=f"session-{self.session.session_id.hex()[:8]}"
        )

    async def wait_tokens(self, offset: int) -> tuple[list[int], bool]:
        """Block until durable tokens beyond `offset` exist, the session ends, or it fails.

        Only tokens whose COMMITTED entry is fsynced are ever returned."""
        s = self.session
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.durable > offset or self.finished or self.error
            )
        if self.error is not None and self.durable <= offset:
            raise self.error
        return s.emitted[offset : self.durable], self.finished and self.durable == len(s.emitted)

    def cancel(self) -> None:
        """End the session after the round in flight (an HTTP client has its stop string or
        left; it cannot come back for the rest): journaled DONE and closed on the verifier
        like a finished one. Tokens already durable stay; nothing more is drafted."""
        self.cancelled = True

    @property
    def finished(self) -> bool:
        return self.session.done and self.durable == len(self.session.emitted)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _run(self) -> None:
        loop = _Loop(start=time.perf_counter() - self.stats.wall_s)
        self.fence_left()  # (after a restart: the verifiers it left may not have heard)
        try:
            await self._drive(loop)
        except Exception as exc:  # a failed session is reported to its clients, not lost
            log.error("session %s failed: %s", self.session.session_id.hex()[:8], exc)
            exc = exc.with_traceback(None)  # its frames would keep the stream alive
            # its clients hear of it only once FAILED is durable (or it is known not to be,
            # and they are told what a restart does): a kill right after they heard finds
            # the session failed, never resumable
            self.error = await self._fail(loop, exc)
        finally:
            if self.send_ahead.sending is not None:
                self.send_ahead.sending.cancel()  # a failed session sends nothing more ahead
            if self.owns_draft_kv:  # in the draft thread: after any speculation still running
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.core.draft_pool, self.drafter.cursor.backend.reset)
            self._let_go()
            await self._notify()

    def _let_go(self) -> None:
        """The session ended: keep what its clients and status read (the session's tokens,
        stats, error) and drop its drafter and its drafts made ahead, with their rows and
        KV cursors. The daemon keeps up to limits.finished_sessions ended runners; each held
        its draft's last logit row (393 KB on the real pair) and clones until forgotten, and
        its MT state the words cached for drawing (22 KB)."""
        self.drafter = self.ahead = self.send_ahead = None  # type: ignore[assignment]
        self.session.forget_draws()

    def _start_draft(self) -> asyncio.Future:
        """Draft the next round in the draft thread; returns (proposal, seconds)."""
        s = self.session
        remaining = s.params.max_tokens - len(s.emitted)
        if s.tree is not None:  # (never deeper than still fits: a round emits depth + 1)
            steps = self.drafter.tree_steps(list(s.transcript), s.state, s.tree.choose(remaining))
        else:
            steps = self.drafter.draft_steps(list(s.transcript), s.state, s.width.choose(remaining))
        return self.core.drafts.draft(self.drafter, steps)

    async def _drive(self, loop: _Loop) -> None:
        s = self.session
        while not s.done and not (self.cancelled and s.prepared is None):
            logs.set_round(s.session_id, s.next_round)  # log lines carry session and round
            if s.prepared is None:
                await self._prepare(loop)
            got = await self._exchange(loop)
            if got is not None:
                await self._conclude(loop, *got)
        await self._finish(loop)

    async def _prepare(self, loop: _Loop) -> None:
        """Steps 1 and 2: the next draft (made ahead, or made now), its signed request, and
        PREPARED durable behind the last result's COMMITTED."""
        s = self.session
        # a failed draft fails the session: `_fail` makes the round before durable
        proposal, loop.draft_s = await (loop.drafting or self._start_draft())
        loop.drafting = None
        self.stats.draft_s += loop.draft_s
        remaining = s.params.max_tokens - len(s.emitted)
        signed_request = s.build_request(
            proposal.drafts,
            proposal.q_rows,
            self.core.private,
            1 if proposal.drafts else s.width.decode_len(remaining),
            parents=proposal.parents,
        )
        prepared = journal.encode_prepared(s.session_id, s.next_round, signed_request)
        await self._append(loop.checked, prepared)
        faults.reached("proposer.after_prepared")
        loop.checked = None
        s.prepared = signed_request
        loop.to_speculate = loop.in_flight = proposal

    async def _exchange(self, loop: _Loop) -> tuple[Signed, pb.RoundResult, float, float] | None:
        """Step 3: the prepared request out (unless it went ahead on this stream) and its
        signed result back, with the seconds it was sent and received. None: the link went
        down (reconnect after a backoff) or the verifier's queue was full (the same request
        again after one); the caller sends again."""
        s = self.session
        try:
            if loop.stream is None:
                loop.stream = await self.core.attach(s)
                loop.backoff = 0.05
            t0 = time.perf_counter()
            wire, loop.on_wire = loop.on_wire, None  # re-sent after any failure below
            signed, raw = await loop.stream.round_trip(
                s.prepared,
                s.fragments,
                lambda: self._sent(loop),
                lambda d: self._decided(loop, d),
                sent=wire,
            )
            t1 = time.perf_counter()
        except LinkDown as exc:
            if loop.stream is not None:
                loop.stream.close()
            loop.stream = None
            now = time.monotonic()
            loop.down_since = loop.down_since or now
            if self.core.pool.pooled and now - loop.down_since >= self.core.pool.failover_s:
                await self._move(loop, f"unreachable for {now - loop.down_since:.1f} s: {exc}")
                return None
            log.warning(
                "session %s round %d: %s; reconnecting in %.2fs",
                s.session_id.hex()[:8],
                s.next_round,
                exc,
                loop.backoff,
            )
            await self._back_off(loop, loop.backoff)
            return None
        except RoundRefused as exc:
            if fenced(exc) and self.core.pool.pooled:
                if loop.stream is not None:
                    loop.stream.close()
                loop.stream = None
                await self._move(loop, f"fenced: {exc}")
                return None
            if exc.reason != QUEUE_FULL:
                raise
            # nothing was written there: the same request goes again, on the same stream
            delay = loop.backoff * (0.5 + random.random())  # jitter: refused sessions spread
            log.info(
                "session %s round %d: the verifier's round queue is full; re-sending in %.2fs",
                s.session_id.hex()[:8],
                s.next_round,
                delay,
            )
            self.stats.queue_full_retries += 1
            await self._back_off(loop, delay)
            return None
        loop.backoff, loop.down_since = 0.05, None
        return signed, raw, t0, t1

    async def _move(self, loop: _Loop, why: str) -> None:
        """Move the session to the next verifier of the pool (proposer_mac.pool): nothing
        goes ahead any more on the stream left, MOVED and the request in flight signed at
        the new epoch are durable before the open there, and the verifier left is told the
        new epoch in the background (`DriverContext.fence`)."""
        s, core = self.session, self.core
        if self.send_ahead.sending is not None:  # its PREPARED lands before MOVED
            sending, self.send_ahead.sending = self.send_ahead.sending, None
            await asyncio.wait([sending])  # (its send fails fast: the stream is closed)
            went = None if sending.cancelled() or sending.exception() else sending.result()
            if went is not None and went.speculation is not None:
                went.speculation.drop()  # drafted on a request the move voids
        if loop.checked is not None:  # (none is pending while a request is in flight)
            await self._commit(loop.checked)
            loop.checked = None
        await core.move_on(s, why)
        loop.on_wire, loop.down_since, loop.backoff = None, None, 0.05
        self.stats.moves += 1
        self.fence_left()

    def fence_left(self) -> None:
        """Tell every verifier the session left its epoch now (`DriverContext.fence`)."""
        s = self.session
        for name in dict.fromkeys(s.homes[:-1]):
            member = self.core.pool.member(name)
            if member is not None and name != s.home:
                in_background(self.core.fence(s, member), f"fencing verifier {name!r}", log)

    @staticmethod
    async def _back_off(loop: _Loop, delay: float) -> None:
        await asyncio.sleep(delay)
        loop.backoff = min(loop.backoff * 2, 1.0)

    async def _conclude(
        self, loop: _Loop, signed: Signed, raw: pb.RoundResult, t0: float, t1: float
    ) -> None:
        """Step 4, and what follows a result: check and apply it in memory, then either the
        next request already went ahead (COMMITTED written now) or the next draft starts
        (COMMITTED goes with its PREPARED, `_commit`)."""
        s = self.session
        result = s.check_result(s.prepared, signed, self.core.verifiers)
        if s.open.capture_layers:  # before anything of the round is emitted
            await self._take_captures(loop, result)
        tokens = s.apply(result)  # in memory only: clients see tokens once COMMITTED is durable
        s.last_result = signed  # the resume point once COMMITTED is durable (see _commit)
        s.width.observe(
            len(result.drafts),
            result.accepted,
            len(result.emitted()),
            draft_s=loop.draft_s,
            verify_s=raw.verify_s,
            round_s=t1 - loop.round_start,
        )
        self.stats.width = s.width.to_dict()
        if s.tree is not None:
            s.tree.observe(result.parents, result.path, round_s=t1 - loop.round_start)
            self.stats.tree_policy = s.tree.to_dict()
        loop.draft_s, loop.round_start = 0.0, t1
        # COMMITTED is written with the next PREPARED (module note): one fsync, not two
        loop.checked = _Checked(
            result, signed, len(tokens), (t0, t1, loop.start), raw, len(s.emitted)
        )
        loop.ack_due = result.round
        checked = loop.checked
        ahead, went = await self.send_ahead.in_flight(
            checked.signed, lambda: self._commit(checked), loop.stream
        )
        if ahead == "held":  # COMMITTED is durable, and the request ahead in flight
            loop.checked = loop.speculation = loop.to_speculate = loop.in_flight = None
            if went is not None:  # (None: recovered, with no draft to go on from)
                loop.in_flight, loop.speculation = went.taken.proposal, went.speculation
                loop.on_wire = went.sent if went.stream is loop.stream else None
            return
        if ahead == "void":  # drafted again, on a new stream (the old one is closed)
            loop.stream, loop.speculation = None, None
        if not s.done and not self.cancelled:
            loop.drafting = asyncio.ensure_future(self.ahead.next_draft(loop.speculation, tokens))
        elif loop.speculation is not None:
            loop.speculation.drop()
        loop.speculation = loop.in_flight = None

    async def _take_captures(self, loop: _Loop, result) -> None:
        """The capture rows the signed result names (muser.capture.result_rows: a fragment
        corrupted or substituted fails the round, nothing of it emitted), handed to a
        conditioned draft in the draft thread, behind any speculation running there
        (`Drafter.install_features`). Rows that did not come leave the draft on its own rows;
        the next round's start again from position 0, the verifier's first since the open."""
        s = self.session
        end = len(s.transcript) + len(result.emitted()) - 1  # the next frontier's position
        fragments, loop.stream.captures = loop.stream.captures, {}
        try:
            got = result_rows(result.capture_digests, fragments, s.session_id, result.round,
                              sorted(s.open.capture_layers), end)  # fmt: skip
        except RefusedError as exc:
            raise ResultRejected(f"round {result.round}: {exc}") from exc
        if got is None:  # a result committed before a verifier restart: its rows are gone
            log.info("session %s round %d: the result's capture rows did not come (committed "
                     "before a verifier restart); the draft drafts on its own rows there",
                     s.session_id.hex()[:8], result.round)  # fmt: skip
            return
        first, rows = got
        self.stats.capture_bytes += sum(len(fragments[d]) for d in result.capture_digests)
        if not hasattr(self.drafter.cursor.backend, "install_features"):
            return
        t0 = time.perf_counter()
        install = self.drafter.install_features
        await asyncio.get_running_loop().run_in_executor(self.core.draft_pool, install, first, rows)
        self.stats.feature_install_s += time.perf_counter() - t0

    async def _finish(self, loop: _Loop) -> None:
        """The session ends: DONE durable (behind the last COMMITTED), the last round acked,
        the stream closed and the session closed on the verifier."""
        s = self.session
        if not s.done:  # cancelled: the session ends at what is durable
            log.info("session %s cancelled after %d tokens", s.session_id.hex()[:8], len(s.emitted))
            s.done = True
        await self._append(loop.checked, journal.encode_done(s.session_id))
        if loop.ack_due is not None and loop.stream is not None:
            await loop.stream.ack(loop.ack_due)
        if loop.stream is not None:
            loop.stream.close()
        await self.core.close_remote(s)

    async def _fail(self, loop: _Loop, exc: Exception) -> Exception:
        """The session failed for good (what `_drive` does not retry: a result that does not
        check, a refusal, a draft that failed). FAILED is journaled, behind the last result's
        COMMITTED and after any request going ahead, so no restart resumes a session whose
        client was told it failed; then it lets go of what it holds: its drafts ahead, its
        stream and, once FAILED is durable, its session on the verifier (a slot of
        limits.max_sessions there). Returns what its clients are told: `exc`, or, when
        FAILED could not be journaled (the journal itself failed), why, and what a restart
        does with the session."""
        s, sid = self.session, self.session.session_id.hex()[:8]
        if self.send_ahead.sending is not None:  # its PREPARED must not land after FAILED
            sending, self.send_ahead.sending = self.send_ahead.sending, None
            await asyncio.wait([sending])
            if not sending.cancelled() and sending.exception() is not None:
                log.info("session %s: the request ahead failed too: %s", sid, sending.exception())
        if loop.drafting is not None:
            loop.drafting.cancel()
        if loop.speculation is not None:
            loop.speculation.drop()
        if loop.stream is not None:
            loop.stream.close()
        try:
            await self._append(
                loop.checked, journal.encode_failed(s.session_id, str(exc) or type(exc).__name__)
            )
        except Exception as journal_exc:
            log.error("session %s: FAILED was not journaled: %s", sid, journal_exc)
            return SessionFailed(f"{exc}; {self._unjournaled(journal_exc)}")
        loop.checked = None
        in_background(
            self.core.close_remote(s), f"closing failed session {sid} on the verifier", log
        )
        return exc

    def _unjournaled(self, journal_exc: Exception) -> str:
        """What a client is told of a failure the journal could not record."""
        sid = self.session.session_id.hex()
        if self.detached:  # journal.DETACHED: a restart (or the journal's reopen) ends it
            return (
                f"its failure could not be journaled ({journal_exc}); it is ended when the "
                "journal is reopened or the proposer restarts"
            )
        return (
            f"its failure could not be journaled ({journal_exc}), so if the proposer restarts "
            f"before its journal is reopened it resumes this session: reconnect with session "
            f"id {sid} and your token offset for the rest"
        )

    def _sent(self, loop: _Loop) -> None:
        """The request is on the wire: the speculation on its proposal starts (not before: it
        would compete with the send), then the ack of the round before goes out."""
        s, stream = self.session, loop.stream
        if loop.to_speculate is not None:
            loop.speculation = self.ahead.start(loop.to_speculate)
            loop.to_speculate = None
            if loop.speculation is not None and stream is not None and self.core.lookahead:
                look_ahead(stream, loop.speculation, s.next_round + 1)
        if loop.ack_due is not None and stream is not None:
            in_background(
                stream.ack(loop.ack_due), "an ack", log
            )  # after the request: off its path
            loop.ack_due = None

    def _decided(self, loop: _Loop, d: pb.Decision) -> None:
        """The verifier's early decision on the round in flight: follow it (`DraftingAhead.follow`),
        and send the next request ahead when a draft on it was ready (`proposer_mac.send_ahead`)."""
        s, core, stream, in_flight = self.session, self.core, loop.stream, loop.in_flight
        if in_flight is None or loop.to_speculate is not None:
            return
        ahead = loop.speculation
        speculation = loop.speculation = self.ahead.follow(ahead, in_flight, d)
        if speculation is None:
            return
        emitted = told_emission(in_flight, d)  # (not None: `follow` drafted on it)
        speculation.told[:] = emitted
        if speculation is not ahead and stream is not None and core.lookahead:
            look_ahead(stream, speculation, s.next_round + 1)  # drafted on it
        if (
            core.send_on_decision
            and speculation is ahead  # drafted before the decision came,
            and speculation.future.done()  # and ready (module note)
            and self.send_ahead.sending is None
            and stream is not None
            and not self.cancelled  # (a request already ahead still goes)
        ):
            outcome = s.predict(
                d.accepted, list(d.decoded), d.next_frontier, d.capture_digests, list(d.path)
            )
            if outcome is not None:  # (now: the result may come before the task runs)
                self.send_ahead.start(stream, speculation, outcome)

    async def _append(self, checked: _Checked | None, record: bytes) -> None:
        """Append `record`, behind the last result's COMMITTED when one is still unwritten."""
        if checked is None:
            await self.core.log.append_async(record)
        else:
            await self._commit(checked, record)

    async def _commit(self, checked: _Checked, *after: bytes) -> None:
        """Make the round's COMMITTED durable, with the records `after` it in the same write
        (the next round's PREPARED, or DONE); only then may clients see its tokens (the
        first `checked.durable`: this round's and those before them)."""
        s, result, raw = self.session, checked.result, checked.raw
        committed = journal.encode_committed(s.session_id, result.round, checked.signed)
        t2 = time.perf_counter()
        await self.core.log.append_many_async([committed, *after])
        faults.reached("proposer.after_committed")
        t0, t1, start = checked.times
        self.durable = max(self.durable, checked.durable)
        remote = raw.verify_s + raw.wal_s + raw.sign_s
        self.stats.verify_s += raw.verify_s
        self.stats.wal_s += raw.wal_s + (time.perf_counter() - t2)
        self.stats.sign_s += raw.sign_s
        self.stats.transport_s += max(0.0, (t1 - t0) - remote)
        tree = self.session.tree  # (None for a tree round recovered after lane.tree_nodes = 0)
        if result.is_tree:  # its depth is what it could accept (LaneStats.tree_nodes)
            self.stats.tree_nodes += len(result.drafts)
            self.stats.tree_shape = tree.to_dict().get("shape") if tree is not None else None
        drafted = tree_depth(result.parents) if result.is_tree else len(result.drafts)
        self.stats.observe_round(drafted, result.accepted, checked.emitted)
        self.stats.wall_s = time.perf_counter() - start
        await self._notify()


@dataclass(frozen=True)
class _Checked:
    """A round's signed result, checked and applied in memory, whose COMMITTED is still to
    be written (`SessionRunner._commit`)."""

    result: object
    signed: Signed
    emitted: int
    """Tokens the round emitted (after clipping)."""
    times: tuple[float, float, float]
    """(request sent, result received, the session's start) on `time.perf_counter`."""
    raw: pb.RoundResult
    durable: int
    """Tokens clients may see once COMMITTED is durable."""


@dataclass
class _Loop:
    """What `SessionRunner._drive` carries from one round to the next."""

    start: float
    """When the session began, on `time.perf_counter` (less the wall of any run before)."""
    stream: RoundStream | None = None
    drafting: asyncio.Future | None = None
    """The next round's draft, begun after the last result (`DraftingAhead.next_draft`)."""
    speculation: Speculating | None = None
    """The round after the one in flight, drafting ahead while it is at the verifier."""
    to_speculate: Draft | None = None
    """This round's proposal until its request is on the wire; the speculation on it starts
    then, not before (the speculative draft would compete with the send)."""
    in_flight: Draft | None = None
    """The proposal of the round at the verifier (None for a round recovered from the
    journal: its decision is not followed)."""
    checked: _Checked | None = None
    """The last result, checked and applied, its COMMITTED not yet written: it goes to the
    log with the next PREPARED (`_commit`)."""
    ack_due: int | None = None
    """The last committed round, acked once the next request is on the wire (its PREPARED
    came durable after COMMITTED: the ack never runs ahead of the commit)."""
    on_wire: pb.RoundRequest | None = None
    """The request in flight when it is already on `stream` (sent ahead)."""
    backoff: float = 0.05
    """Seconds before the next reconnect or re-send; doubles to 1 s, reset on success."""
    down_since: float | None = None
    """When (time.monotonic) the verifier stopped answering this session; None while it
    answers. Past proposer.failover_s the session moves (`SessionRunner._move`)."""
    draft_s: float = 0.0
    """Seconds the round in flight waited for its draft."""
    round_start: float = field(default_factory=time.perf_counter)
