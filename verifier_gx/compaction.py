"""The verifier's commit log, compacted: a snapshot of what replay leaves, so that the log on
disk and a restart's replay are bounded by the sessions still open, not by every round the
verifier ever served.

SNAPSHOT (canonical, domain "verifier-journal-snapshot"): the replayed state after a seq

    u32 open sessions, each:
        blob SessionOpen bytes, u64 epoch, u32s prompt, blob the open's proposer signature,
        u32s the tokens after the prompt, blob the MT19937 state before the next round,
        u64 next round, u64 tokens handed to clients, u32 done (0 or 1),
        u32 committed rounds, each: u64 round, raw 32 request digest, blob Signed(RoundResult)
    u32 closed sessions, each (replay.SessionSummary):
        raw 16 session id, u64 epoch, u64 rounds, u64 tokens handed to clients, u32 done,
        raw 32 genesis head, raw 32 head

An open session keeps every round it committed: a retry of any of them is answered byte for
byte, and another request at one is an equivocation. A closed session keeps its summary,
which is all `replay.Replay` holds of it. `replay_from_snapshot` checks what replaying the
records would have checked of that state: the kept rounds run consecutively up to the
session's next round, each chains from the one before it (from the genesis head when round
0 is kept) and is signed by the key it names (given keys), and the last one's head, MT
state digest and transcript digest are the session's.

`LogCompactor.compact` replays the latest snapshot and the records after it (chains only:
every signature was checked when the daemon wrote or recovered it), off the event loop, and
writes the snapshot at the last record it read; the log then drops the segments its kept
snapshots cover (wal/log.py). A restart replays the latest snapshot and the records after
it. `verifier.commit_compact_bytes` sets how many bytes of segments pile up between
compactions, checked as sessions close.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser.canonical import CanonicalError, Reader, Writer
from muser.errors import JournalError
from muser.mt19937 import Mt19937
from muser.records import (
    RoundResult,
    SessionOpen,
    Signed,
    sha256,
    state_digest,
    tokens_bytes,
    transcript_digest,
)
from verifier_gx.journal import decode
from verifier_gx.replay import Replay, SessionState, SessionSummary, check_signature
from wal.base import Snapshot

log = logging.getLogger("muser.verifier")

SNAPSHOT_DOMAIN = "verifier-journal-snapshot"


def snapshot_of(replay: Replay) -> bytes:
    w = Writer(SNAPSHOT_DOMAIN).u32(len(replay.sessions))
    for s in replay.sessions.values():
        w.blob(s.open.encode()).u64(s.epoch).u32s(s.prompt).blob(s.open_signature)
        w.u32s(s.transcript[len(s.prompt) :]).blob(s.mt.to_bytes())
        w.u64(s.next_round).u64(s.produced).u32(int(s.done)).u32(len(s.committed))
        for round_ in sorted(s.committed):
            digest, signed = s.committed[round_]
            w.u64(round_).raw(digest, 32).blob(signed)
    w.u32(len(replay.closed))
    for c in replay.closed.values():
        w.raw(c.session_id, 16).u64(c.epoch).u64(c.rounds).u64(c.emitted).u32(int(c.done))
        w.raw(c.genesis_head, 32).raw(c.head, 32)
    return w.bytes()


def replay_from_snapshot(
    data: bytes,
    verifier_keys: Mapping[str, Ed25519PublicKey] | None = None,
    proposer_keys: Mapping[str, Ed25519PublicKey] | None = None,
) -> Replay:
    """The Replay a snapshot holds, ready for the records after it. Raises JournalError
    (or CanonicalError) naming the session and round that does not hold."""
    r = Reader(data, SNAPSHOT_DOMAIN)
    replay = Replay(verifier_keys, proposer_keys)
    for _ in range(r.u32()):
        state = _open_session(r, verifier_keys)
        if state.session_id in replay.sessions:
            raise JournalError(f"session {state.session_id.hex()} twice")
        replay.sessions[state.session_id] = state
    for _ in range(r.u32()):
        sid, epoch, rounds, emitted, done = r.raw(16), r.u64(), r.u64(), r.u64(), r.u32()
        summary = SessionSummary(
            sid, epoch, rounds, emitted, _flag(done, sid), r.raw(32), r.raw(32)
        )
        if sid in replay.sessions or sid in replay.closed:
            raise JournalError(f"session {sid.hex()} twice")
        replay.closed[sid] = summary
    r.end()
    return replay


def replay_log(log, verifier_keys: Mapping[str, Ed25519PublicKey] | None = None):
    """The log's latest snapshot, then every durable record after it: the Replay and the
    last seq read (the snapshot's when no record follows it; 0 for an empty log). A part
    that does not replay raises JournalError naming it ("snapshot at seq N", "record N")."""
    snap = log.latest_snapshot()
    replay, last = Replay(verifier_keys=verifier_keys), 0
    if snap is not None:
        try:
            replay = replay_from_snapshot(snap.data, verifier_keys)
        except (CanonicalError, JournalError) as exc:
            raise JournalError(f"snapshot at seq {snap.seq} does not replay: {exc}") from exc
        last = snap.seq
    for record in log.records(last + 1 if snap is not None else log.first_seq):
        try:
            replay.apply(decode(record.payload))
        except (CanonicalError, JournalError) as exc:
            raise JournalError(f"record {record.seq} does not replay: {exc}") from exc
        last = record.seq
    return replay, last


def _flag(value: int, sid: bytes) -> bool:
    if value > 1:
        raise JournalError(f"session {sid.hex()}: done flag {value}, expected 0 or 1")
    return bool(value)


def _open_session(r: Reader, verifier_keys: Mapping[str, Ed25519PublicKey] | None) -> SessionState:
    open_ = SessionOpen.decode(r.blob())
    epoch, prompt, signature, generated = r.u64(), r.u32s(), r.blob(), r.u32s()
    sid = open_.session_id
    where = f"session {sid.hex()}"
    try:
        mt = Mt19937.from_bytes(r.blob())
    except ValueError as exc:
        raise JournalError(f"{where}: the MT19937 state is not a state: {exc}") from exc
    next_round, produced, done = r.u64(), r.u64(), _flag(r.u32(), sid)
    committed = {}
    for _ in range(r.u32()):
        round_, digest, signed = r.u64(), r.raw(32), r.blob()
        committed[round_] = (digest, signed)
    if not prompt or sha256(tokens_bytes(prompt)) != open_.prompt_digest:
        raise JournalError(f"{where}: the prompt does not hash to the open's prompt digest")
    rounds = sorted(committed)
    if rounds != list(range(rounds[0] if rounds else 0, next_round)):
        raise JournalError(f"{where}: rounds {rounds} kept; expected every round to {next_round}")
    transcript = [*prompt, *generated]
    head, last = open_.genesis_head(), None
    for round_ in rounds:
        digest, signed_bytes = committed[round_]
        signed = Signed.decode(signed_bytes)
        result = RoundResult.decode(signed.body)
        at = f"{where} round {round_}"
        chained = result.prev_head == head if (last is not None or round_ == 0) else True
        if (result.session_id, result.round, result.request_digest) != (sid, round_, digest):
            raise JournalError(f"{at}: the signed result is not this session's round")
        if result.epoch > epoch or not chained or result.head != result.expected_head():
            raise JournalError(f"{at}: the result does not chain from the head before it")
        if verifier_keys is not None:
            check_signature(verifier_keys, result.verifier_key_id, signed, at)
        head, last = result.head, result
    if last is None:
        fresh = state_digest(Mt19937.from_seed(open_.params.seed))
        if generated or state_digest(mt) != fresh:
            raise JournalError(f"{where}: no round kept, yet tokens or draws after the prompt")
    elif (state_digest(mt), transcript_digest(transcript)) != (
        last.post_state_digest,
        last.transcript_digest,
    ):
        raise JournalError(f"{where}: the MT state or transcript is not its last round's")
    if produced > len(generated):
        raise JournalError(f"{where}: {produced} tokens handed out of {len(generated)}")
    return SessionState(
        open_, epoch, prompt, signature, transcript, head, mt, next_round, produced, done, committed
    )


class LogCompactor:
    """Snapshots a verifier's commit log once `limit` bytes of segments have piled up since
    the last snapshot (0: never)."""

    def __init__(self, log, limit: int) -> None:
        self.log, self.limit = log, limit
        self._compacting = threading.Lock()
        self._closed = False
        self._compacted_at = self.segment_bytes()
        """Bytes of segments the last compaction (or the start) left on disk."""

    def segment_bytes(self) -> int:
        return sum(
            e.stat().st_size for e in os.scandir(self.log.directory) if e.name.endswith(".wal")
        )

    def compact(self) -> Snapshot | None:
        """Snapshot the log at its last durable record and let it drop the segments that
        covers. Blocking: call it off the event loop. None when nothing was written since
        the last snapshot."""
        with self._compacting:
            if self._closed:
                return None
            snap = self.log.latest_snapshot()  # only this lock's holder writes one
            replay, last = replay_log(self.log)  # chains only (see the module note)
            if last == (snap.seq if snap is not None else 0):
                return None
            data = snapshot_of(replay)
            written = self.log.write_snapshot(data, last)
            self._compacted_at = self.segment_bytes()
            log.info(
                "commit log snapshot at seq %d: %d open and %d closed sessions, %d bytes; "
                "%d bytes of segments left",
                last, len(replay.sessions), len(replay.closed), len(data), self._compacted_at,
            )  # fmt: skip
            return written

    async def close(self) -> None:
        """No compaction from now on; wait for one in flight (the server stops before the
        log closes, so a snapshot never drops segments under a reader of the closed log)."""
        self._closed = True

        def wait() -> None:
            with self._compacting:
                pass

        await asyncio.to_thread(wait)

    async def maybe_compact(self) -> None:
        """Compact (in a worker thread, one compaction at a time) once `limit` bytes of
        segments have piled up since the last snapshot."""
        if not self.limit or self._compacting.locked():
            return
        if self.segment_bytes() - self._compacted_at >= self.limit:
            try:
                await asyncio.to_thread(self.compact)
            except Exception as exc:  # the log itself is intact: only the snapshot failed
                log.error("commit log compaction failed (the log keeps growing): %s", exc)
