"""The proposer's core (`ProposerCore`): the draft backend, the session journal, sessions and
their recovery, the verifier channel. `proposer_mac.daemon` serves it (gRPC, health, HTTP).

At start the core replays the journal and resumes every unfinished session, so a client that
reconnects with its session id and a token offset receives the rest without gaps or repeats.

A journal that fails a write or an fsync (a full disk) refuses every append from then on:
the sessions that were appending fail, the daemon reports NOT_SERVING (muser.health) and
refuses new sessions UNAVAILABLE, and every `proposer.journal_retry_s` it tries to reopen
the journal (`reopen_journal`): a probe file must take its bytes and an fsync, then the
log is closed and opened again (recovery truncates what the failed write left half done),
and FAILED is journaled for every session the journal would resume but no runner here is
running (their clients were told they failed). Then it serves again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

import grpc

from cluster_config import ClusterConfig
from muser import keys
from muser.backend import batches
from muser.errors import MuserError, RefusedError
from muser.health import Health
from muser.records import Identity, RoundResult
from muser.sampling import SamplingParams, check_stop_tokens
from muser.stats import DaemonStats, LaneStats
from muser.tasks import in_background
from muser.wire import convert
from muser.wire import muser_v2_pb2 as pb
from proposer_mac import journal
from proposer_mac.backends.ngram import NgramDraft
from proposer_mac.context import DriverContext
from proposer_mac.drafting import Drafter
from proposer_mac.driver import SessionRunner
from proposer_mac.lane_setup import (
    context_length_from_files,
    draft_kv,
    identity_of,
    lookahead_on,
    session_capture_layers,
    session_tree,
    session_width,
    speculate_branches,
    target_identity_from_files,
)
from proposer_mac.link import LinkDown
from proposer_mac.pool import VerifierPool
from proposer_mac.session import ProposerSession, SessionFailed

log = logging.getLogger("muser.proposer")


class ProposerCore:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        draft=None,
        target_identity: Identity | None = None,
        tokenizer=None,
    ):
        self.config = config
        p = config.proposer
        self.private = keys.Signer(keys.load_private(p.key))
        self.key_id = keys.key_id(self.private.public_key())
        self.verifiers = {
            keys.key_id(k): k for k in map(keys.load_public, config.enrolment.verifiers)
        }
        if draft is None:
            from proposer_mac.backends import draft_options, load_draft_backend

            opts = draft_options(p.backend, device=p.device, dtype=p.dtype)
            draft = load_draft_backend(p.backend, p.draft, **opts)
        self.draft = draft
        self.capture_layers = session_capture_layers(config.lane, draft)
        """The layers every session captures: a conditioned draft's own, else the lane's."""
        self.draft_batch = config.lane.draft_batch and batches(draft)
        """Sessions draft on sequences of `draft` and wait in the draft thread together."""
        self.draft_identity = identity_of(draft.identity)
        self.target_identity = target_identity or target_identity_from_files(config)
        if self.target_identity is not None:
            self.check_draft_target()
        self.target_context_length: int | None = context_length_from_files(config)
        """The target's context window: from its files when they are on this machine, else
        as its verifier reports it (`ask_target_identity`)."""
        Path(p.wal_dir).mkdir(parents=True, exist_ok=True)
        self.health = Health(SERVICE)
        self.stats = DaemonStats(faults=self.health.faults)
        """Journal fsyncs; the rounds are each runner's LaneStats (`metrics_view` sums them)."""
        self.log = self._open_journal()
        self._reopening: asyncio.Task | None = None
        self.pool = VerifierPool.from_config(config)
        """A channel to each verifier sessions may live on (proposer_mac.pool)."""
        self.context = DriverContext(
            private=self.private,
            verifiers=self.verifiers,
            log=self.log,
            pool=self.pool,
            speculate=config.lane.speculate,
            branches=speculate_branches(config.lane, draft),
            send_on_decision=config.lane.send_on_decision,
            lookahead=lookahead_on(config.lane.lookahead, config.verifier.address),
            batch_with=draft if self.draft_batch else None,
            on_draft=self._draft_health,
        )
        self._compacting = threading.Lock()
        self._compacted_at = self.journal_bytes()
        """Bytes of segments the last compaction (or the start) left on disk."""
        self.runners: dict[bytes, SessionRunner] = {}
        self.retired = LaneStats(phases={})
        """The summed stats of finished sessions forgotten beyond limits.finished_sessions."""
        self._tokenizer = tokenizer
        self._token_bytes: int | None = None

    def check_draft_target(self) -> None:
        """A conditioned draft reads only the target it was trained for: refused at start
        against any other, naming both. Any draft drafts only ids the target's rows reach."""
        from proposer_mac.backends import limit_to_target
        from proposer_mac.backends.conditioned import pair_check

        pair_check(self.draft, self.target_identity, "proposer start (verifier.target)")
        limit_to_target(self.draft, self.target_identity.vocab_size)

    # ---- the journal and its failure --------------------------------------------------------

    def _open_journal(self):
        from wal import FileLog

        return FileLog(
            Path(self.config.proposer.wal_dir) / "journal",
            on_fsync=self.stats.observe_fsync,
            on_failure=self._journal_failed,
        )

    def _journal_failed(self, reason: str) -> None:
        """The journal refuses appends (told from the thread that saw the failure)."""
        retry = self.config.proposer.journal_retry_s
        self.health.fault(
            "wal",
            f"the session journal failed: {reason}; new sessions are refused, and the "
            f"proposer tries to reopen it every {retry:g} s (proposer.journal_retry_s) until "
            "its disk takes writes again",
        )

    def _draft_health(self, exc: BaseException | None) -> None:
        """A draft raised (`exc`), or one ran (None): the daemon's draft health."""
        self.health.fault("draft", None if exc is None else f"the draft backend raised {exc!r}")

    def check_serving(self) -> None:
        """Refuse a new session while the journal cannot append (UNAVAILABLE: retry later)."""
        reason = self.health.reason("wal")
        if reason is not None:
            raise NotServing(reason)

    def watch(self) -> None:
        """Start `watch_journal` on the running loop (the daemon does, once serving)."""
        self._reopening = asyncio.ensure_future(self.watch_journal())

    async def watch_journal(self) -> None:
        """While the journal has failed, try to reopen it every proposer.journal_retry_s
        (run for the daemon's life; `reopen_journal` does the work in a thread)."""
        while True:
            await asyncio.sleep(self.config.proposer.journal_retry_s)
            if self.health.reason("wal") is None:
                continue
            try:
                await asyncio.to_thread(self.reopen_journal)
            except Exception as exc:
                log.warning("the session journal is not back yet: %s", exc)

    def reopen_journal(self, probe_bytes: int = 1 << 20) -> None:
        """Probe the journal's directory with `probe_bytes` written and fsynced; close the
        failed log and open it again (its recovery truncates a half-written tail); journal
        FAILED for every session it would resume that no runner here is running; serve
        again. Blocking: call it off the event loop. Raises while the disk still refuses."""
        from wal import _fs

        directory = Path(self.config.proposer.wal_dir) / "journal"
        probe = directory / "probe.tmp"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * probe_bytes)
                _fs.fsync_file(fd)
            finally:
                os.close(fd)
        finally:
            probe.unlink(missing_ok=True)
        self.log.close()
        fresh = self._open_journal()
        try:
            owed = [
                journal.encode_failed(sid, "the session journal failed under it")
                for sid, js in self._replayed(log=fresh).items()
                if not js.done and not self._running(sid)
            ]
            if owed:
                fresh.append_many(owed)
        except BaseException:
            fresh.close()
            raise
        self.log = self.context.log = fresh
        self.health.fault("wal", None)
        log.warning(
            "the session journal reopened at seq %d; %d failed session(s) journaled FAILED",
            fresh.last_seq, len(owed),
        )  # fmt: skip

    def _running(self, sid: bytes) -> bool:
        runner = self.runners.get(sid)
        return runner is not None and runner.error is None and not runner.finished

    async def close(self) -> None:
        """Stop watching the journal, wait for a compaction in flight, close the journal."""
        if self._reopening is not None:
            self._reopening.cancel()
        await asyncio.to_thread(self._compacting.acquire)
        self._compacting.release()
        self.log.close()
        await self.pool.close()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.config.proposer.draft))
        return self._tokenizer

    def _runner(self, session: ProposerSession) -> SessionRunner:
        # each session drafts on a KV of its own when the backend has them: a sequence (one
        # batched forward drafts many) or a fork (torch, mlx); interleaved sessions then never
        # re-prefill each other's transcripts
        own = self.draft_batch or hasattr(self.draft, "fork")
        # a tree is drafted on a sequence of the draft's own (`Drafter.tree_steps`)
        # a torch draft drafts trees on a sequence of its own; prompt lookup on its fork
        tree_seq = session.tree is not None and hasattr(self.draft, "sequence")
        backend = draft_kv(self.draft, self.draft_batch or tree_seq)
        drafter = Drafter(backend, session.params, self.config.lane.q_top_k)
        if self.config.lane.lookup_stop and isinstance(self.draft, NgramDraft):
            # its decode rounds end where its lookup matches (`ProposerSession.lookup`)
            session.lookup = (self.draft.min_n, self.draft.max_n)
        runner = SessionRunner(session, drafter, self.context, owns_draft_kv=own)
        self.runners[session.session_id] = runner
        self._forget_finished()
        return runner

    def _start(self, runner: SessionRunner) -> None:
        """Run the session; once it ends, see whether the journal wants compacting."""
        runner.start()
        runner.task.add_done_callback(
            lambda _: in_background(self.maybe_compact(), "journal compaction", log)
        )

    def _forget_finished(self) -> None:
        """Keep at most limits.finished_sessions finished sessions (the oldest go first);
        their stats are folded into `retired`, so the metrics' counters never go back."""
        finished = [sid for sid, r in self.runners.items() if r.finished or r.error is not None]
        for sid in finished[: max(0, len(finished) - self.config.limits.finished_sessions)]:
            self.retired.merge(self.runners.pop(sid).stats)
        self.retired.prune()

    def _replayed(self, on_record=None, log=None) -> dict[bytes, journal.JournaledSession]:
        """The journal's sessions (of `log`, default the daemon's): its latest snapshot,
        then every durable record after it (each seq handed to `on_record` when given)."""
        log = log or self.log
        snap = log.latest_snapshot()
        base = journal.decode_snapshot(snap.data) if snap is not None else None
        records = log.records(snap.seq + 1 if snap is not None else log.first_seq)

        def payloads():
            for record in records:
                if on_record is not None:
                    on_record(record.seq)
                yield record.payload

        return journal.replay(payloads(), base)

    def journal_bytes(self) -> int:
        """Bytes of journal segments on disk."""
        directory = Path(self.config.proposer.wal_dir) / "journal"
        return sum(e.stat().st_size for e in os.scandir(directory) if e.name.endswith(".wal"))

    def compact_journal(self):
        """Snapshot the journal at its last durable record (every unfinished session and the
        latest `limits.finished_sessions` finished ones, see proposer_mac/journal.py) and let
        the commit log drop the segments it covers. Blocking: call it off the event loop.
        Returns the snapshot, or None when nothing was journaled since the last one."""
        with self._compacting:
            last = [0]
            sessions = self._replayed(lambda seq: last.__setitem__(0, seq))
            if not last[0]:
                return None
            keep = self.config.limits.finished_sessions
            data = journal.snapshot_of(sessions, keep)
            snap = self.log.write_snapshot(data, last[0])
            self._compacted_at = self.journal_bytes()
            log.info(
                "journal snapshot at seq %d: %d sessions, %d bytes; %d bytes of segments left",
                snap.seq, len(journal.retained(sessions, keep)), len(data), self._compacted_at,
            )  # fmt: skip
            return snap

    async def maybe_compact(self) -> None:
        """Compact once `proposer.journal_compact_bytes` of segments have piled up since the
        last snapshot (in a worker thread; one compaction at a time)."""
        limit = self.config.proposer.journal_compact_bytes
        if not limit or self._compacting.locked():
            return
        if self.journal_bytes() - self._compacted_at >= limit:
            try:
                await asyncio.to_thread(self.compact_journal)
            except Exception as exc:  # the journal itself is intact: only the snapshot failed
                log.error("journal compaction failed (the journal keeps growing): %s", exc)

    def recover(self) -> int:
        """Rebuild sessions from the journal; start a runner for each unfinished one, except
        those whose client cannot reconnect (DETACHED: the HTTP API's), which are ended with
        FAILED journaled: resumed, they would generate for nobody."""
        resumed = 0
        replayed = self._replayed()
        ended = {
            sid: "the proposer restarted, and its client (an HTTP request) cannot reconnect"
            for sid, js in replayed.items()
            if js.detached and not js.done
        }
        if ended:
            self.log.append_many([journal.encode_failed(sid, why) for sid, why in ended.items()])
            for sid, why in ended.items():
                replayed[sid].done, replayed[sid].failed = True, why
        for sid, js in replayed.items():
            session = ProposerSession.from_open(
                js.open,
                js.epoch,
                js.prompt,
                js.draft_len,
                session_width(self.config.lane, js.draft_len),
            )
            session.homes = list(js.homes)
            session.tree = session_tree(self.config.lane, js.draft_len)
            for signed in js.committed:
                result = RoundResult.decode(signed.body)
                session.apply(result)
                session.last_result = signed
                session.width.restore(len(result.drafts), result.accepted, len(result.emitted()))
                if session.tree is not None:
                    session.tree.restore(result.parents, result.path)
            session.prepared, session.ahead = js.prepared, js.ahead
            if not js.done and session.home is not None and session.home not in self.pool.members:
                # its verifier left the cluster file: it moves to one there before it resumes
                to = self.pool.members[self.pool.current]
                self.log.append_many(self.context.moved(session, to))
                log.warning("session %s lived on verifier %r, which [[pool]] no longer lists; "
                            "moved to %r at epoch %d", sid.hex()[:8], session.homes[-2], to.name,
                            session.epoch)  # fmt: skip
            # a failed one is not done: a client that reconnects gets its tokens, then why
            session.done = session.done or (js.done and js.failed is None)
            runner = self._runner(session)
            if js.failed is not None:
                runner.error = SessionFailed(f"session {sid.hex()[:8]} failed: {js.failed}")
            elif not session.done:
                self._start(runner)
                resumed += 1
            log.info(
                "session %s recovered at round %d (%s)",
                sid.hex()[:8],
                session.next_round,
                "failed" if js.failed else "done" if session.done else "resuming",
                extra={"session": sid.hex(), "round": session.next_round},
            )
        return resumed

    async def new_session(self, request: pb.GenerateRequest) -> SessionRunner:
        params = convert.params_from_pb(request.params)
        self._check_fits(len(request.prompt_tokens), "prompt_tokens")
        prompt = list(request.prompt_tokens)
        if not prompt and request.prompt:  # tokenizing holds a thread for up to seconds
            prompt = await asyncio.to_thread(self.encode_prompt, request.prompt)
        return await self.start_session(prompt, params, request.draft_len)

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt text to token ids, refused first when its size alone shows that it cannot
        fit the context window (blocking: call it off the event loop)."""
        from proposer_mac.openai_request import max_token_bytes, text_limit

        size = len(text.encode("utf-8"))
        context = self.target_context_length
        if self._token_bytes is None:
            self._token_bytes = max_token_bytes(self.tokenizer) or 0
        limit = text_limit(context, self._token_bytes)
        if limit is not None and size > limit:
            raise RefusedError(
                f"the prompt is {size} bytes of text; no token of this model spells more than "
                f"{self._token_bytes} bytes, so it cannot fit the context window of {context} "
                f"tokens (at most {limit} bytes); nothing was tokenized"
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check_fits(self, n: int, what: str) -> None:
        context = self.target_context_length
        if context is not None and n > context:
            raise RefusedError(
                f"the prompt is {n} tokens ({what}); the model's context window is {context} "
                "positions"
            )

    async def start_session(
        self,
        prompt: list[int],
        params: SamplingParams,
        draft_len: int = 0,
        *,
        detached: bool = False,
    ) -> SessionRunner:
        """Open a session on a tokenized prompt; the gRPC and HTTP front ends both land here.
        `detached`: its client cannot reconnect (an HTTP request), so a restart ends it
        instead of resuming it (journal.DETACHED)."""
        self.check_serving()
        limits = self.config.limits
        if params.max_tokens > limits.max_tokens:
            raise RefusedError(
                f"max_tokens {params.max_tokens} exceeds the cluster limit {limits.max_tokens}"
            )
        if not prompt:
            raise RefusedError("the prompt is empty: give prompt text or prompt_tokens")
        self._check_fits(len(prompt), "prompt")
        vocab = self.target_identity.vocab_size
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise RefusedError(f"prompt token {bad[0]} outside the vocabulary [0, {vocab})")
        check_stop_tokens(params, vocab)  # before anything is journaled (the verifier would)
        lane = self.config.lane
        if draft_len and not lane.draft_len_min <= draft_len <= lane.draft_len_max:
            raise RefusedError(
                f"draft_len {draft_len} is outside the cluster's lane range "
                f"[{lane.draft_len_min}, {lane.draft_len_max}] (lane.draft_len_min/_max)"
            )
        session = ProposerSession.create(
            prompt,
            params,
            self.target_identity,
            self.draft_identity,
            self.key_id,
            draft_len,
            self.capture_layers,
            width=session_width(lane, draft_len),
        )
        session.tree = session_tree(lane, draft_len)
        left = asyncio.Event()
        opening = asyncio.ensure_future(self._open(session, prompt, draft_len, left, detached))
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            # the caller left (a client disconnected) mid-open: the open goes on (its OPEN
            # may be durable already), and a session that opens ends before its first
            # round, DONE journaled and closed on the verifier
            left.set()
            opening.add_done_callback(_cancel_opened)
            raise

    async def _open(
        self,
        session: ProposerSession,
        prompt: list[int],
        draft_len: int,
        left: asyncio.Event,
        detached: bool = False,
    ) -> SessionRunner:
        """OPEN journaled, the session opened on the verifier, its runner started (cancelled
        from the start when its caller `left`). An open the verifier refuses or never
        answers journals FAILED behind the OPEN, so no restart resumes a session whose client
        was told it failed."""
        records = [journal.encode_open(session.open, session.epoch, prompt, draft_len, detached)]
        if self.pool.pooled:  # where it lives, journaled before it is opened there
            session.place(self.pool.current, session.epoch)
            records.append(journal.encode_moved(session.session_id, session.epoch, session.home))
        await self.log.append_many_async(records)
        try:
            await self._open_in_pool(session)
        except Exception as exc:
            sid = session.session_id.hex()[:8]
            try:
                reason = f"its open failed: {exc}"
                await self.log.append_async(journal.encode_failed(session.session_id, reason))
            except Exception as failed_exc:  # the OPEN stays: a restart resumes the session
                log.error("session %s: its open failed (%s) and FAILED was not journaled: %s",
                          sid, exc, failed_exc)  # fmt: skip
            else:
                log.info("session %s: its open failed, journaled FAILED: %s", sid, exc)
            raise
        runner = self._runner(session)
        runner.detached = detached
        runner.stats.moves += session.moves  # moved before its first round (no answer)
        runner.fence_left()
        if left.is_set():
            runner.cancel()
        self._start(runner)
        return runner

    async def _open_in_pool(self, session: ProposerSession) -> None:
        """Open the session where it lives; when that verifier does not answer within
        proposer.failover_s, move it to the next one of the pool (MOVED durable first) and
        open it there, until every verifier was tried once."""
        for tries_left in range(len(self.pool.order) - 1, -1, -1):
            try:
                await self.context.open_remote(session)
                return
            except LinkDown as exc:
                if not tries_left:
                    raise
                await self.context.move_on(session, f"its open went unanswered: {exc}")


SERVICE = "muser.v2.Proposer"


class NotServing(MuserError):
    """The proposer cannot take a session now (its journal failed): retry later."""

    code = grpc.StatusCode.UNAVAILABLE


def _cancel_opened(opening: asyncio.Future) -> None:
    """For a session opened as its caller left: end it after the round in flight, if any
    (or, when the open failed, only take its exception: the log has it)."""
    if opening.cancelled():
        return
    if opening.exception() is None:
        opening.result().cancel()
