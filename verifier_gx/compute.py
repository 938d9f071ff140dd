"""A batch of rounds on the target, in the round queue's worker thread (docs/design.md §6 step 3
and the signed result of step 4): witness rows of the rounds waiting together in one target
forward over each session's own KV (verifier_gx.kvpool), decode rounds step by step
(verifier_gx.decode), then per round judge, build the RoundResult, check it against the
session and sign it. The WAL commit and the state change stay with the session
(verifier_gx.sessions)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from muser import keys
from muser.backend import ModelBackend
from muser.capture import encode_capture
from muser.health import backend_failure
from muser.logprobs import token_logprobs
from muser.records import RoundRequest, RoundResult, Signed, state_digest, transcript_digest
from muser.sampling import target_probs
from muser.stats import VerifierStats
from muser.tree import TreeDecision, judge_tree
from muser.verify import RoundDecision, judge_round
from verifier_gx.decode import decode_batch, decode_decision
from verifier_gx.executor import Capture, Witness, witness_each
from verifier_gx.kvpool import KvPool
from verifier_gx.replay import SessionState

log = logging.getLogger("muser.verifier")


OnDecided = Callable[[RoundDecision | TreeDecision, tuple[bytes, ...]], None]
"""Hears a round's early decision and the capture digests its result will name."""


@dataclass(frozen=True)
class RoundJob:
    """One round waiting for the target (its session lock is held meanwhile)."""

    state: SessionState
    request: RoundRequest
    digest: bytes
    on_decided: OnDecided | None = None
    """Told the decision and the capture digests its result will name, in the worker thread
    as soon as it is judged, before the result is signed and committed (the early decision
    the proposer may draft on, and send its next request on); must not block."""


def _tell(job: RoundJob, decision: RoundDecision, capture_digests: tuple[bytes, ...]) -> None:
    """Hand `job` its early decision (and the capture digests its result will name); a hint
    that cannot be sent changes nothing."""
    try:
        job.on_decided(decision, capture_digests)
    except Exception as exc:
        log.warning("the early decision of a round was not sent: %s", exc)


def _fragments(job: RoundJob, captured) -> list[tuple[bytes, bytes]]:
    """A round's capture fragments ((digest, data), in layer order) from its computed
    `(first position, [(layer, rows)])`."""
    first, rows_by_layer = captured
    return [
        encode_capture(job.state.session_id, job.request.round, layer, first, rows)
        for layer, rows in rows_by_layer
    ]


class RoundComputer:
    def __init__(
        self,
        backend: ModelBackend,
        kv: KvPool,
        signing_key: keys.SigningKey,
        stats: VerifierStats,
        clock: Callable[[], float],
        on_target: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        self.backend, self.kv, self.stats, self.clock = backend, kv, stats, clock
        self.on_target = on_target
        """Told, after each batch's forwards, the exception a forward raised that was not a
        refusal of its round (a failed backend), or None when they ran (the daemon's
        health: muser.health)."""
        self.signing_key = signing_key
        self.key_id = keys.key_id(signing_key.public_key())
        self._lock = threading.Lock()
        """Serialises the target between batches."""

    def decide(self, jobs: list[RoundJob]) -> list[tuple | BaseException]:
        """Compute, judge and sign a batch of rounds in one worker thread (docs/design.md §6 step
        3 and the result of step 4): one hop from the event loop and back per batch. Each
        job's session lock (held by its caller) keeps its session still; the backend lock
        serialises the target. A failure is its own round's: the others go on."""
        with self._lock:
            t0 = self.clock()
            computed, ahead_s = self._compute_batch(jobs)
            share = (self.clock() - t0) / len(jobs)
        fragments: list[list | BaseException] = []
        for job, c in zip(jobs, computed, strict=True):
            try:  # hashed before the decision is told: it names them (send-on-decision)
                fragments.append(c if isinstance(c, BaseException) else _fragments(job, c[1]))
            except Exception as exc:
                fragments.append(exc)
        for job, c, frags in zip(jobs, computed, fragments, strict=True):
            if job.on_decided is not None and not isinstance(frags, BaseException):
                _tell(job, c[0], tuple(d for d, _ in frags))  # before signing and the commit
        out: list[tuple | BaseException] = []
        for job, c, frags, early in zip(jobs, computed, fragments, ahead_s, strict=True):
            if isinstance(frags, BaseException):
                out.append(frags)
                continue
            try:  # a round served by a lookahead counts the forward it took then
                out.append(self._sign(job, c[0], frags, c[2], verify_s=share + early))
            except Exception as exc:  # raised in the round's own coroutine
                out.append(exc)
        return out

    def _sign(self, job: RoundJob, decision: RoundDecision, captures, rows, *, verify_s: float):
        """Build the RoundResult naming the round's `captures` ((digest, data) fragments),
        with the logprobs of its emitted tokens from their raw `rows` when its session asked
        for them, check it against the state and sign it."""
        state, request, digest = job.state, job.request, job.digest
        tree = request.tree if request.is_tree else None
        emitted = decision.emitted(tree) if tree else decision.emitted(request.drafts)
        k = state.params.logprobs
        logprobs = () if k is None else token_logprobs(rows, emitted, k)
        result = RoundResult(
            state.session_id,
            request.round,
            request.epoch,
            state.head,
            digest,
            request.frontier,
            tuple(request.drafts),
            decision.accepted,
            decision.next_frontier,
            state_digest(decision.post_state),
            transcript_digest(state.transcript + emitted),
            tuple(d for d, _ in captures),
            b"\0" * 32,
            self.key_id,
            () if tree else decision.decoded,
            tuple(request.parents),
            tuple(decision.path) if tree else (),
            logprobs,
        )
        result = replace(result, head=result.expected_head())
        post = state.check_round(result, digest)
        body = result.encode()
        t0 = self.clock()
        signed = Signed(body, self.signing_key.sign(body)).encode()
        timings = {"verify_s": verify_s, "sign_s": self.clock() - t0, "wal_s": 0.0}
        return decision, result, captures, post, signed, timings

    def _compute_batch(self, jobs: list[RoundJob]) -> tuple[list[tuple | BaseException], list]:
        """Witness rows (one forward for the rounds without capture), judge, settle each
        round's KV. Runs in the worker thread under the backend lock. `verify_s` of a batched
        round is its share of the batch's compute wall, so the sums stay the target's wall;
        also returns each round's lookahead seconds (the forward made before its request)."""
        out: list[tuple | BaseException | None] = [None] * len(jobs)
        executors = [self.kv.executor(job.state.session_id) for job in jobs]
        logits: dict[int, np.ndarray] = {}
        captured: dict[int, dict[int, np.ndarray]] = {}
        captures = [self._capture(job) for job in jobs]
        # capturing rounds share the forward where the backend captures per sequence (beside
        # a tree: under its mask, `evaluate_mixed_capture`); else each chain goes alone
        in_batch = hasattr(self.backend, "evaluate_batch_capture") and (
            hasattr(self.backend, "evaluate_mixed_capture")
            or not any(job.request.is_tree for job in jobs)
        )
        batched, decoding = [], []
        for i, (job, ex) in enumerate(zip(jobs, executors, strict=True)):
            transcript = job.state.transcript
            if job.state.next_round > 0:  # round 0 prefills the prompt: not a rebuild
                held = ex.cursor.reusable(transcript[:-1])
                self.stats.kv_rebuilt_tokens += len(transcript) - 1 - held
            if job.request.decode_len > 1:  # a decode round: its steps depend on each other
                decoding.append(i)
            elif captures[i] is None or in_batch or job.request.is_tree:
                batched.append(i)
            else:
                try:
                    logits[i] = ex.witness_logits(transcript, job.request.drafts, captures[i])
                    captured[i] = ex.captured
                except Exception as exc:
                    ex.cursor.realign()
                    out[i] = exc
        self._decode_batch(jobs, executors, decoding, captures, out)
        rounds = [  # a tree round goes in the same forward, with its tree (witness_batch)
            Witness(executors[i], jobs[i].state.transcript, jobs[i].request.drafts,
                    jobs[i].request.tree if jobs[i].request.is_tree else None, captures[i])
            for i in batched
        ]  # fmt: skip
        for i, got in zip(batched, witness_each(self.backend, rounds), strict=True):
            if isinstance(got, Exception):
                out[i] = got
            else:
                logits[i] = got
                if captures[i] is not None:
                    captured[i] = executors[i].captured
        self._tell_target(out)
        for i, (job, ex) in enumerate(zip(jobs, executors, strict=True)):
            if out[i] is not None:
                continue
            try:
                out[i] = self._judge(job, ex, logits[i], captured.get(i, {}))
            except Exception as exc:
                out[i] = exc
        ahead_s = [ex.ahead_s if i in batched else 0.0 for i, ex in enumerate(executors)]
        self.stats.lookahead_hits += sum(1 for s in ahead_s if s > 0)
        return out, ahead_s  # type: ignore[return-value]

    def _capture(self, job: RoundJob) -> Capture | None:
        """What a round of a capturing session keeps: its layers' rows from the first position
        not sent to the proposer yet (muser.capture); None when the session captures nothing
        or the backend cannot."""
        layers = tuple(sorted(set(job.state.open.capture_layers)))
        if not layers or not hasattr(self.backend, "evaluate_capture"):
            return None
        return Capture(job.state.capture_from, layers)

    def _tell_target(self, out: list) -> None:
        """The batch's forwards ran, or one raised something other than a refusal of its
        round (a MuserError names what the round did wrong; anything else is the backend's)."""
        if self.on_target is None:
            return
        try:
            self.on_target(backend_failure(out))
        except Exception as exc:  # health is reported, never a round's failure
            log.warning("the target's health was not updated: %s", exc)

    def look_ahead(
        self, session_id: bytes, transcript: list[int], drafts: list[int], layers=()
    ) -> bool:
        """Evaluate a round before its request (`TargetExecutor.look_ahead`; with a capturing
        session's `layers`), on the KV the session already holds (a session whose KV is not
        held gets none: no eviction and no rebuild for a hint). Runs in a worker thread; the
        caller holds the session's lock. False when it did not run."""
        with self._lock:
            ex = self.kv.holding(session_id)
            if ex is None:
                return False
            if layers and not hasattr(self.backend, "evaluate_capture"):
                layers = ()  # (its rounds capture nothing either: `_capture`)
            try:
                seconds = ex.look_ahead(transcript, drafts, self.clock, layers)
            except Exception as exc:  # a hint that cannot be evaluated changes nothing
                ex.cursor.realign()
                log.debug("a lookahead was not evaluated: %s", exc)
                return False
            if seconds is None:
                return False
            self.stats.lookaheads += 1
            self.stats.lookahead_s += seconds
            return True

    def _decode_batch(
        self, jobs: list[RoundJob], executors: list, which: list[int], captures: list, out: list
    ):
        """The decode rounds `which` of the batch, in lockstep (`decode_batch`): out[i] gets
        round i's (decision, its captures: every step's rows, muser.capture) or its
        exception."""
        work = [
            (executors[i], jobs[i].state.transcript, jobs[i].state.mt, jobs[i].request.decode_len,
             jobs[i].state.params, captures[i], jobs[i].request.lookup)
            for i in which
        ]  # fmt: skip
        for i, decoded in zip(which, decode_batch(self.backend, work), strict=True):
            if isinstance(decoded, Exception):
                out[i] = decoded
                continue
            kept = (
                (jobs[i].state.capture_from, sorted(decoded.captured.items()))
                if captures[i]
                else (0, [])
            )
            out[i] = (decode_decision(decoded, jobs[i].state.mt), kept, decoded.logits)

    def _judge(self, job: RoundJob, ex, logits: np.ndarray, captured: dict[int, np.ndarray]):
        state, request = job.state, job.request
        witness = target_probs(logits, state.params)
        if request.is_tree:  # (admission replayed its drafting draws; this replays them again)
            tree = request.tree
            decision = judge_tree(state.mt, request.frontier, tree, witness,
                                  greedy=state.params.greedy, max_nodes=tree.size)  # fmt: skip
            ex.keep_tree_path(request.frontier, tree, decision.path, logits)
            # the rows not sent yet before the frontier, the frontier's, the accepted path's
            before = len(state.transcript) - 1 - state.capture_from
            at = [*range(before + 1), *(before + 1 + i for i in decision.path)]
            judged = [0, *(1 + i for i in decision.path)]  # the rows the emitted tokens met
            return (
                decision,
                (state.capture_from, [(layer, captured[layer][at]) for layer in sorted(captured)]),
                logits[judged],
            )
        decision: RoundDecision = judge_round(
            state.mt,
            request.frontier,
            request.drafts,
            request.q_rows,
            witness,
            greedy=state.params.greedy,
        )
        ex.settle(len(state.transcript), decision.accepted)
        # rows from capture_from up to the next frontier (muser.capture): the positions not
        # sent yet before the round, its frontier and its accepted drafts
        first, end = state.capture_from, len(state.transcript) + decision.accepted
        return (
            decision,
            (first, [(layer, captured[layer][: end - first]) for layer in sorted(captured)]),
            logits[: decision.accepted + 1],
        )
