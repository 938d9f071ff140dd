"""The proposer's session journal: what it promised and what the verifier signed.

Entries (canonical, domain "proposer-journal"; a tag byte first):

    OPEN       session open record, epoch, prompt tokens, draft length
    DETACHED   the same as OPEN, for a session whose client cannot reconnect (the HTTP
               API's): a restart ends it (FAILED) instead of resuming it for nobody
    PREPARED   round, Signed(RoundRequest) — journaled and fsynced before it is sent
    COMMITTED  round, Signed(RoundResult)  — journaled and fsynced before any token is emitted
    DONE       session finished (max tokens or a stop token)
    FAILED     session failed (why, as its client was told): finished, never resumed
    MOVED      the session lives on the pool verifier named here from this epoch on: once
               when it opens (epoch 1), then each time it moves (a higher epoch); journaled
               before the open there, with the request in flight signed again at that epoch

Replaying the journal rebuilds every session: transcript, head, MT state, the request still
in flight (re-sent byte for byte on restart; the verifier answers it from its WAL).

A PREPARED may run one round ahead: round r + 1's request, sent on round r's early decision
before r's signed result (lane.send_on_decision), is journaled before COMMITTED r. It is the
request in flight once COMMITTED r is replayed if it expects the head that result carries;
otherwise it is void (the verifier's fenced head check refuses it, so it was never
committed) and the PREPARED of round r + 1 journaled after it takes its place.

Compaction: every request is journaled whole (its draft rows are most of a round's bytes),
so the journal is snapshotted now and then (`snapshot_of`, domain
"proposer-journal-snapshot"): every unfinished session as replay leaves it (open, epoch,
prompt, draft length, its committed results, the request in flight) and the latest finished
ones a restarted daemon still serves to reconnecting clients. The commit log then drops the
segments the snapshot covers; replay starts from the snapshot (`replay(..., base=)`).
Committed requests are not kept: a committed round needs only its signed result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muser.canonical import Reader, Writer, domain_of
from muser.errors import RefusedError
from muser.records import (
    RoundRequest,
    RoundResult,
    SessionOpen,
    Signed,
    request_of,
    result_of,
    sha256,
)

DOMAIN = "proposer-journal"
SNAPSHOT_DOMAIN = "proposer-journal-snapshot-4"
"""4: each session names the pool verifiers it lived on (MOVED), its home last."""
SNAPSHOT_DOMAIN_3 = "proposer-journal-snapshot-3"
"""3: each session says whether its client can reconnect (DETACHED)."""
SNAPSHOT_DOMAIN_2 = "proposer-journal-snapshot-2"
"""2: each session keeps the request journaled ahead of its round in flight, too."""
SNAPSHOT_DOMAIN_1 = "proposer-journal-snapshot"
"""The snapshot before requests went ahead: still read."""
SNAPSHOT_DOMAINS = (SNAPSHOT_DOMAIN, SNAPSHOT_DOMAIN_3, SNAPSHOT_DOMAIN_2, SNAPSHOT_DOMAIN_1, None)
"""The snapshots this interpreter reads (None: not a canonical record, refused by name)."""
OPEN, PREPARED, COMMITTED, DONE, FAILED, DETACHED, MOVED = 1, 2, 3, 4, 5, 6, 7
OPENS = (OPEN, DETACHED)


def encode_open(
    open_: SessionOpen, epoch: int, prompt: list[int], draft_len: int, detached: bool = False
) -> bytes:
    tag = DETACHED if detached else OPEN
    return (
        Writer(DOMAIN).u32(tag).blob(open_.encode()).u64(epoch).u32s(prompt).u32(draft_len).bytes()
    )


def encode_prepared(session_id: bytes, round_: int, signed: Signed) -> bytes:
    return (
        Writer(DOMAIN).u32(PREPARED).raw(session_id, 16).u64(round_).blob(signed.encode()).bytes()
    )


def encode_committed(session_id: bytes, round_: int, signed: Signed) -> bytes:
    return (
        Writer(DOMAIN).u32(COMMITTED).raw(session_id, 16).u64(round_).blob(signed.encode()).bytes()
    )


def encode_done(session_id: bytes) -> bytes:
    return Writer(DOMAIN).u32(DONE).raw(session_id, 16).bytes()


def encode_failed(session_id: bytes, reason: str) -> bytes:
    """The session failed for good (its client was told `reason`): a restart must not
    resume it, and a client that reconnects is told it failed."""
    return Writer(DOMAIN).u32(FAILED).raw(session_id, 16).text(reason).bytes()


def encode_moved(session_id: bytes, epoch: int, verifier: str) -> bytes:
    """The session lives on pool verifier `verifier` from `epoch` on (journaled before it
    is opened there)."""
    return Writer(DOMAIN).u32(MOVED).raw(session_id, 16).u64(epoch).text(verifier).bytes()


@dataclass
class JournaledSession:
    open: SessionOpen
    epoch: int
    prompt: list[int]
    draft_len: int
    committed: list[Signed] = field(default_factory=list)
    prepared: Signed | None = None
    """The request in flight: PREPARED with no COMMITTED after it."""
    ahead: Signed | None = None
    """The next round's request, journaled on the early decision of the one in flight."""
    done: bool = False
    failed: str | None = None
    """Why it failed (FAILED), if it did; it is then done too."""
    detached: bool = False
    """Its client cannot reconnect (DETACHED): a restart ends it, never resumes it."""
    homes: list[str] = field(default_factory=list)
    """The pool verifiers it lived on, in order (MOVED), where it lives now last; empty for
    a session journaled before pools (it lives on [verifier])."""


def replay(payloads, base: dict[bytes, JournaledSession] | None = None):
    """Rebuild sessions from journal payloads in order, after `base` (a decoded snapshot)
    when the journal was compacted. Returns {session id: JournaledSession}."""
    sessions: dict[bytes, JournaledSession] = dict(base or {})
    for payload in payloads:
        r = Reader(payload, DOMAIN)
        tag = r.u32()
        if tag in OPENS:
            open_ = SessionOpen.decode(r.blob())
            sessions[open_.session_id] = JournaledSession(open_, r.u64(), r.u32s(), r.u32())
            sessions[open_.session_id].detached = tag == DETACHED
        elif tag in (PREPARED, COMMITTED):
            sid, round_, signed = r.raw(16), r.u64(), Signed.decode(r.blob())
            s = sessions[sid]
            if tag == PREPARED:
                if round_ == len(s.committed):
                    s.prepared = signed
                elif round_ == len(s.committed) + 1 and s.prepared is not None:
                    s.ahead = signed
                else:
                    raise ValueError(
                        f"journal: round {round_} prepared after {len(s.committed)} committed"
                    )
            else:
                if round_ != len(s.committed):
                    raise ValueError(f"journal: round {round_} committed after {len(s.committed)}")
                s.committed.append(signed)
                s.prepared, s.ahead = next_in_flight(s.ahead, signed), None
        elif tag == MOVED:
            s, epoch, home = sessions[r.raw(16)], r.u64(), r.text()
            if epoch < s.epoch:
                raise ValueError(f"journal: moved to epoch {epoch} below epoch {s.epoch}")
            # the request ahead went to the verifier left; the one in flight follows, signed
            # again at this epoch (its PREPARED comes next)
            s.epoch, s.ahead = epoch, None
            s.homes.append(home)
        elif tag == DONE:
            sessions[r.raw(16)].done = True
        elif tag == FAILED:
            s = sessions[r.raw(16)]
            s.done, s.failed = True, r.text()
        else:
            raise ValueError(f"journal: unknown entry tag {tag}")
        r.end()
    return sessions


def next_in_flight(ahead: Signed | None, committed: Signed) -> Signed | None:
    """The request journaled ahead of a round, once that round's result is `committed`:
    in flight if it expects the head the result carries, else void (None)."""
    if ahead is None:
        return None
    head = result_of(committed).head  # (decoded only when not made or received here)
    return ahead if request_of(ahead).expected_head == head else None


def retained(
    sessions: dict[bytes, JournaledSession], keep_finished: int
) -> dict[bytes, JournaledSession]:
    """What a snapshot keeps of replayed `sessions`: every unfinished one and the
    `keep_finished` latest finished ones (journal order). A failed one is not kept: a client
    that reconnects to it after a compaction is told the session is unknown (never that it
    finished)."""
    sessions = {sid: s for sid, s in sessions.items() if s.failed is None}
    finished = [sid for sid, s in sessions.items() if s.done]
    dropped = set(finished[: max(0, len(finished) - keep_finished)])
    return {sid: s for sid, s in sessions.items() if sid not in dropped}


def snapshot_of(sessions: dict[bytes, JournaledSession], keep_finished: int) -> bytes:
    """The snapshot of replayed `sessions` (`retained`), each as replay leaves it."""
    kept = retained(sessions, keep_finished)
    w = Writer(SNAPSHOT_DOMAIN).u32(len(kept))
    for s in kept.values():
        w.blob(s.open.encode()).u64(s.epoch).u32s(s.prompt).u32(s.draft_len)
        w.blobs(signed.encode() for signed in s.committed)
        w.blob(s.prepared.encode() if s.prepared is not None else b"")
        w.blob(s.ahead.encode() if s.ahead is not None else b"").u32(int(s.done))
        w.u32(int(s.detached))
        w.blobs(home.encode() for home in s.homes)
    return w.bytes()


def decode_snapshot(data: bytes) -> dict[bytes, JournaledSession]:
    domains = {4: SNAPSHOT_DOMAIN, 3: SNAPSHOT_DOMAIN_3, 2: SNAPSHOT_DOMAIN_2, 1: SNAPSHOT_DOMAIN_1}
    version = {d: v for v, d in domains.items()}.get(
        domain_of(data) or "", 4
    )  # an unknown domain is refused by name by the newest reader
    r = Reader(data, domains[version])
    ahead = version >= 2
    sessions: dict[bytes, JournaledSession] = {}
    for _ in range(r.u32()):
        open_ = SessionOpen.decode(r.blob())
        s = JournaledSession(open_, r.u64(), r.u32s(), r.u32())
        s.committed = [Signed.decode(b) for b in r.blobs()]
        prepared = r.blob()
        s.prepared = Signed.decode(prepared) if prepared else None
        request = r.blob() if ahead else b""
        s.ahead = Signed.decode(request) if request else None
        if s.ahead is not None and s.prepared is None:
            raise RefusedError("journal snapshot: a request ahead with none in flight")
        done = r.u32()
        if done > 1:
            raise RefusedError(f"journal snapshot: done flag must be 0 or 1, got {done}")
        s.done = bool(done)
        detached = r.u32() if version >= 3 else 0
        if detached > 1:
            raise RefusedError(f"journal snapshot: detached flag must be 0 or 1, got {detached}")
        s.detached = bool(detached)
        if version >= 4:
            try:
                s.homes = [home.decode() for home in r.blobs()]
            except UnicodeDecodeError as exc:
                raise RefusedError(
                    f"journal snapshot: a verifier name is not UTF-8: {exc}"
                ) from None
        if open_.session_id in sessions:
            raise RefusedError(f"journal snapshot: session {open_.session_id.hex()} twice")
        sessions[open_.session_id] = s
    r.end()
    return sessions


def describe(payload: bytes) -> dict:
    """A JSON-able description of one entry (for `muser wal inspect`)."""
    r = Reader(payload, DOMAIN)
    tag = r.u32()
    if tag in OPENS:
        open_ = SessionOpen.decode(r.blob())
        return {
            "entry": "open" if tag == OPEN else "open detached",
            "session": open_.session_id.hex(),
            "epoch": r.u64(),
            "genesis_head": open_.genesis_head().hex(),
        }
    if tag in (PREPARED, COMMITTED):
        sid, round_, signed = r.raw(16), r.u64(), Signed.decode(r.blob())
        out = {
            "entry": "prepared" if tag == PREPARED else "committed",
            "session": sid.hex(),
            "round": round_,
        }
        if tag == COMMITTED:
            out["head"] = RoundResult.decode(signed.body).head.hex()
        else:
            out["request_digest"] = RoundRequest.decode(signed.body).digest().hex()
        return out
    if tag == MOVED:
        return {
            "entry": "moved",
            "session": r.raw(16).hex(),
            "epoch": r.u64(),
            "verifier": r.text(),
        }
    if tag == DONE:
        return {"entry": "done", "session": r.raw(16).hex()}
    if tag == FAILED:
        return {"entry": "failed", "session": r.raw(16).hex(), "reason": r.text()}
    raise ValueError(f"unknown entry tag {tag}")


class WalInterpreter:
    """`wal.interpret` adapter: `muser wal inspect/verify` on a proposer journal.

    Checks, per session, that every COMMITTED result chains from the genesis head
    (prev_head = the head before it, head = H(prev_head ‖ record)) and answers the PREPARED
    request before it; given --pubkey files, that every result is signed by the key it names
    and every request by the proposer key the session opened with. A compacted journal's
    chains start in its snapshot, whose results are checked the same way (their requests
    were not kept) before the records after it."""

    name = "proposer-journal"

    def describe(self, payload: bytes) -> dict | None:
        try:
            return describe(payload)
        except (ValueError, RefusedError):
            return None

    def check_chain(self, records, pubkeys, snapshot) -> str | None:
        from muser import keys as keymod
        from muser.walkeys import keys_by_id

        keys = keys_by_id(pubkeys) if pubkeys else None
        heads: dict[bytes, bytes] = {}
        prepared: dict[tuple[bytes, int], Signed] = {}
        """Requests journaled and not yet answered, by (session, round): one may run a round
        ahead of the one in flight (the module note)."""
        owner: dict[bytes, str] = {}

        def committed(where: str, sid: bytes, signed: Signed, request: Signed | None):
            """Check one result; `request` None for a snapshot's (requests are not kept)."""
            result = RoundResult.decode(signed.body)
            if result.prev_head != heads[sid] or result.head != result.expected_head():
                return f"{where}: result does not chain from the head before it"
            if request is not None and result.request_digest != sha256(request.body):
                return f"{where}: result does not answer the PREPARED request before it"
            if keys is not None:
                key = keys.get(result.verifier_key_id)
                if key is None:
                    return f"{where}: no --pubkey for verifier key {result.verifier_key_id}"
                keymod.verify(key, signed.body, signed.signature, where)
            heads[sid] = result.head
            return None

        def request(where: str, sid: bytes, signed: Signed) -> None:
            prepared[sid, RoundRequest.decode(signed.body).round] = signed
            if keys is not None and owner[sid] in keys:
                keymod.verify(keys[owner[sid]], signed.body, signed.signature, where)

        floor = 0
        if snapshot is not None and domain_of(snapshot.data) not in SNAPSHOT_DOMAINS:
            snapshot = None  # another daemon's (its interpreter checks it); junk is decoded
        if snapshot is not None:
            floor = snapshot.seq
            try:
                base = decode_snapshot(snapshot.data)
            except RefusedError as exc:
                return f"snapshot at seq {floor}: {exc}"
            for sid, s in base.items():
                heads[sid], owner[sid] = s.open.genesis_head(), s.open.proposer_key_id
                for i, signed in enumerate(s.committed):
                    where = f"snapshot at seq {floor}: session {sid.hex()[:8]} round {i}"
                    try:
                        failure = committed(where, sid, signed, None)
                    except RefusedError as exc:
                        failure = f"{where}: {exc}"
                    if failure is not None:
                        return failure
                for signed in (s.prepared, s.ahead):
                    if signed is not None:
                        request(f"snapshot at seq {floor}: session {sid.hex()[:8]}", sid, signed)
        for seq, payload in ((r.seq, r.payload) for r in records):
            if seq <= floor:
                continue  # covered by the snapshot (kept until the next one drops it)
            where = f"seq {seq}"
            try:
                r = Reader(payload, DOMAIN)
            except RefusedError:
                continue  # not a journal entry: another interpreter's business
            try:
                tag = r.u32()
                if tag in OPENS:
                    open_ = SessionOpen.decode(r.blob())
                    heads[open_.session_id] = open_.genesis_head()
                    owner[open_.session_id] = open_.proposer_key_id
                    continue
                if tag not in (PREPARED, COMMITTED):
                    continue
                sid, round_, signed = r.raw(16), r.u64(), Signed.decode(r.blob())
                where = f"seq {seq}: session {sid.hex()[:8]} round {round_}"
                if sid not in heads:
                    return f"{where}: entry for a session with no OPEN before it"
                if tag == PREPARED:
                    request(where, sid, signed)
                    continue
                if (sid, round_) not in prepared:
                    return f"{where}: result does not answer the PREPARED request before it"
                failure = committed(where, sid, signed, prepared.pop((sid, round_)))
                if failure is not None:
                    return failure
            except RefusedError as exc:
                return f"{where}: {exc}"
        return None
