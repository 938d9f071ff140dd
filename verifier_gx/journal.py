"""The verifier's commit-log entries, the session state they replay to, and their interpreter.

Entries are canonical (muser.canonical, domain "verifier-journal"), a u32 tag first:

    OPEN   1  SessionOpen bytes, epoch u64, prompt token ids u32s, proposer signature blob
    ROUND  2  request digest (32 bytes), Signed(RoundResult) bytes — exactly what was sent,
              so a retry gets the same bytes back
    EPOCH  3  session id (16 bytes), new epoch u64 — a higher epoch fenced the old one
    CLOSE  4  session id (16 bytes)
    RESUME 5  SessionOpen bytes, epoch u64, prompt token ids u32s, proposer signature blob,
              Signed(RoundResult) bytes of the round the session resumes after (signed by an
              enrolled verifier, this one or another), the MT19937 state after that round
              (blob), the transcript after the prompt up to that round (u32s)

`Replay` applies entries in order and checks every ROUND against the state the entries
before it imply: round index, epoch, prev_head → head (head = H(prev_head ‖ round record),
starting at the genesis head of OPEN), the post-round MT19937 state digest (pre-round state
advanced by `draws_for_round`) and the transcript digest. Daemon recovery and
`muser wal verify` run this same code, so what one accepts the other accepts.

RESUME starts (or moves) a session at a round committed elsewhere: a proposer whose last
committed round this verifier does not hold (another node, a lost commit log) carries that
signed round, the MT state and the transcript after it; `SessionState.resumed` checks the
signature against the enrolled verifier keys and the state and transcript against the
round's digests, and the chain goes on from that round's head. The daemon and `wal verify`
check it alike.

The proposer signs `SessionOpen.signed_message(epoch)` to open (the epoch is covered, so a
captured open cannot be replayed at a higher epoch to fence the session) and
`muser.records.close_message(session, epoch)` to close.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys
from muser.canonical import CanonicalError, Reader, Writer, domain_of
from muser.errors import (
    FragmentMismatchError,
    JournalError,
    RefusedError,
    ResumeMismatchError,
    SessionFinishedError,
    UnenrolledKeyError,
)
from muser.mt19937 import Mt19937
from muser.records import (
    RoundResult,
    SessionOpen,
    Signed,
    advance,
    draws_for_round,
    sha256,
    state_digest,
    tokens_bytes,
    transcript_digest,
)
from muser.round import clip_emission
from muser.sampling import SamplingParams
from wal.base import Snapshot

DOMAIN = "verifier-journal"
OPEN, ROUND, EPOCH, CLOSE, RESUME = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class OpenEntry:
    open: SessionOpen
    epoch: int
    prompt: tuple[int, ...]
    signature: bytes


@dataclass(frozen=True)
class RoundEntry:
    request_digest: bytes
    signed: bytes
    """Signed(RoundResult).encode(): the bytes a retry returns unchanged."""

    def decode(self) -> tuple[Signed, RoundResult]:
        signed = Signed.decode(self.signed)
        return signed, RoundResult.decode(signed.body)


@dataclass(frozen=True)
class EpochEntry:
    session_id: bytes
    epoch: int


@dataclass(frozen=True)
class CloseEntry:
    session_id: bytes


@dataclass(frozen=True)
class ResumeEntry:
    open: SessionOpen
    epoch: int
    prompt: tuple[int, ...]
    signature: bytes
    """The proposer's, over `open.signed_message(epoch, resume)`."""
    resume: bytes
    """Signed(RoundResult) bytes of the round the session resumes after."""
    mt: bytes
    """The MT19937 state after that round (Mt19937.to_bytes)."""
    generated: tuple[int, ...]
    """The transcript after the prompt, up to and including that round's emission."""


Entry = OpenEntry | RoundEntry | EpochEntry | CloseEntry | ResumeEntry


def encode(entry: Entry) -> bytes:
    w = Writer(DOMAIN)
    if isinstance(entry, OpenEntry):
        w.u32(OPEN).blob(entry.open.encode()).u64(entry.epoch).u32s(entry.prompt)
        w.blob(entry.signature)
    elif isinstance(entry, RoundEntry):
        w.u32(ROUND).raw(entry.request_digest, 32).blob(entry.signed)
    elif isinstance(entry, EpochEntry):
        w.u32(EPOCH).raw(entry.session_id, 16).u64(entry.epoch)
    elif isinstance(entry, CloseEntry):
        w.u32(CLOSE).raw(entry.session_id, 16)
    elif isinstance(entry, ResumeEntry):
        w.u32(RESUME).blob(entry.open.encode()).u64(entry.epoch).u32s(entry.prompt)
        w.blob(entry.signature).blob(entry.resume).blob(entry.mt).u32s(entry.generated)
    else:
        raise TypeError(f"not a verifier journal entry: {type(entry).__name__}")
    return w.bytes()


def decode(payload: bytes) -> Entry:
    """Raises CanonicalError on bytes that are not exactly one entry."""
    r = Reader(payload, DOMAIN)
    tag = r.u32()
    if tag == OPEN:
        entry: Entry = OpenEntry(SessionOpen.decode(r.blob()), r.u64(), tuple(r.u32s()), r.blob())
    elif tag == ROUND:
        entry = RoundEntry(r.raw(32), r.blob())
    elif tag == EPOCH:
        entry = EpochEntry(r.raw(16), r.u64())
    elif tag == CLOSE:
        entry = CloseEntry(r.raw(16))
    elif tag == RESUME:
        open_, epoch, prompt = SessionOpen.decode(r.blob()), r.u64(), tuple(r.u32s())
        entry = ResumeEntry(open_, epoch, prompt, r.blob(), r.blob(), r.blob(), tuple(r.u32s()))
    else:
        raise CanonicalError(f"unknown verifier journal entry tag {tag} (expected 1..5)")
    r.end()
    return entry


def short(session_id: bytes) -> str:
    return session_id.hex()[:8]


def resume_point(
    open_: SessionOpen,
    epoch: int,
    resume: bytes,
    verifier_keys: Mapping[str, Ed25519PublicKey] | None,
) -> RoundResult:
    """The round `resume` (Signed(RoundResult) bytes) carries, checked to be a round of this
    session, at or below `epoch`, chained by its own head and signed by an enrolled verifier
    (unless `verifier_keys` is None). CanonicalError on bytes that are not a signed result."""
    signed = Signed.decode(resume)
    result = RoundResult.decode(signed.body)
    where = f"resume point (round {result.round})"
    if verifier_keys is not None:
        public = verifier_keys.get(result.verifier_key_id)
        if public is None:
            raise UnenrolledKeyError(
                f"{where} signed by verifier key {result.verifier_key_id!r}, which is not "
                f"enrolled; enrolled verifier keys: {sorted(verifier_keys)}"
            )
        keys.verify(public, signed.body, signed.signature, where)
    sid = open_.session_id
    if result.session_id != sid:
        raise ResumeMismatchError(
            f"{where} belongs to session {result.session_id.hex()}, not {sid.hex()}"
        )
    if result.epoch > epoch:
        raise ResumeMismatchError(
            f"{where} was committed at epoch {result.epoch}, after the open's epoch {epoch}"
        )
    if result.head != result.expected_head():
        raise ResumeMismatchError(
            f"{where} head {result.head.hex()} is not H(prev_head ‖ round record) "
            f"= {result.expected_head().hex()}"
        )
    return result


# --- session state ---------------------------------------------------------------------------


@dataclass
class SessionState:
    """One session as the committed entries define it. `mt` is the pre-round MT19937 state."""

    open: SessionOpen
    epoch: int
    prompt: list[int]
    open_signature: bytes
    transcript: list[int]
    """Prompt + every token rounds emitted (unclipped; the proposer digests the same)."""
    head: bytes
    mt: Mt19937
    next_round: int = 0
    produced: int = 0
    """Tokens handed to clients: emissions clipped at stop tokens and max_tokens."""
    done: bool = False
    committed: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    """round -> (request digest, Signed(RoundResult) bytes)."""

    @classmethod
    def fresh(cls, entry: OpenEntry) -> SessionState:
        return cls(
            entry.open,
            entry.epoch,
            list(entry.prompt),
            entry.signature,
            list(entry.prompt),
            entry.open.genesis_head(),
            Mt19937.from_seed(entry.open.params.seed),
        )

    @property
    def session_id(self) -> bytes:
        return self.open.session_id

    @property
    def params(self) -> SamplingParams:
        return self.open.params

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.produced

    def check_round(self, result: RoundResult, request_digest: bytes) -> Mt19937:
        """Every field of `result` against this state; returns the post-round MT state."""
        where = f"session {short(self.session_id)} round {result.round}"
        fields = [
            ("session", result.session_id.hex(), self.session_id.hex()),
            ("round", result.round, self.next_round),
            ("epoch", result.epoch, self.epoch),
            ("prev_head", result.prev_head.hex(), self.head.hex()),
            ("request_digest", result.request_digest.hex(), request_digest.hex()),
            ("frontier", result.frontier, self.transcript[-1]),
        ]
        for name, got, expected in fields:
            if got != expected:
                raise JournalError(f"{where}: {name} is {got!r}, expected {expected!r}")
        if self.done:
            raise JournalError(f"{where}: the session already finished at round {self.next_round}")
        depth, emitted = len(result.drafts), result.emitted()
        if not 0 <= result.accepted <= depth:
            raise JournalError(f"{where}: accepted {result.accepted} of {depth} drafts")
        if depth and result.decoded:
            raise JournalError(f"{where}: decoded {list(result.decoded)} in a round with drafts")
        post = advance(
            self.mt, draws_for_round(depth, result.accepted, self.params.greedy, len(emitted))
        )
        if state_digest(post) != result.post_state_digest:
            raise JournalError(
                f"{where}: post-round MT state digest {result.post_state_digest.hex()} is not "
                f"the pre-round state advanced by the round's draws ({state_digest(post).hex()})"
            )
        expected_transcript = transcript_digest(self.transcript + emitted)
        if result.transcript_digest != expected_transcript:
            raise JournalError(
                f"{where}: transcript digest {result.transcript_digest.hex()}, expected "
                f"{expected_transcript.hex()}"
            )
        if result.head != result.expected_head():
            raise JournalError(
                f"{where}: head {result.head.hex()} is not H(prev_head ‖ round record) "
                f"= {result.expected_head().hex()}"
            )
        return post

    def apply_round(
        self, result: RoundResult, request_digest: bytes, signed: bytes, post: Mt19937
    ) -> list[int]:
        """Move past a checked, durable round; returns the tokens it hands to clients."""
        emitted = result.emitted()
        emission = clip_emission(
            emitted, self.produced, self.params.max_tokens, self.params.stop_tokens
        )
        self.mt = post
        self.transcript += emitted
        self.produced += len(emission.tokens)
        self.done = emission.done
        self.head = result.head
        self.committed[result.round] = (request_digest, signed)
        self.next_round += 1
        return emission.tokens

    @classmethod
    def resumed(
        cls, entry: ResumeEntry, verifier_keys: Mapping[str, Ed25519PublicKey] | None
    ) -> SessionState:
        """The session at the round `entry` resumes after, every part of it checked against
        that round as an enrolled verifier signed it (its signature too, unless
        `verifier_keys` is None: a replay given no keys checks chains only). Raises the
        refusal a live open maps to a status (the replay turns it into a JournalError);
        CanonicalError on bytes that are not a signed round result."""
        result = resume_point(entry.open, entry.epoch, entry.resume, verifier_keys)
        sid, where = entry.open.session_id, f"resume point (round {result.round})"
        transcript = [*entry.prompt, *entry.generated]
        if transcript_digest(transcript) != result.transcript_digest:
            raise FragmentMismatchError(
                f"the transcript sent ({len(entry.prompt)} prompt + {len(entry.generated)} "
                f"tokens) digests to {transcript_digest(transcript).hex()}; {where} committed "
                f"{result.transcript_digest.hex()}"
            )
        try:
            mt = Mt19937.from_bytes(entry.mt)
        except ValueError as exc:
            raise FragmentMismatchError(f"the MT19937 state sent is not a state: {exc}") from exc
        if state_digest(mt) != result.post_state_digest:
            raise FragmentMismatchError(
                f"the MT19937 state sent digests to {state_digest(mt).hex()}; {where} "
                f"committed {result.post_state_digest.hex()}"
            )
        params = entry.open.params
        emission = clip_emission(entry.generated, 0, params.max_tokens, params.stop_tokens)
        if emission.done:
            raise SessionFinishedError(
                f"session {short(sid)} finished at {where} ({len(emission.tokens)} tokens); "
                "there is nothing to resume"
            )
        return cls(
            entry.open,
            entry.epoch,
            list(entry.prompt),
            entry.signature,
            transcript,
            result.head,
            mt,
            next_round=result.round + 1,
            produced=len(entry.generated),
            committed={result.round: (result.request_digest, entry.resume)},
        )

    def summary(self) -> dict:
        return SessionSummary.of(self).summary()


@dataclass(frozen=True)
class SessionSummary:
    """A session's place in its chain; all that `Replay` keeps of a closed session. A closed
    session answers nothing (`SessionClosedError`), so its transcript, MT state and signed
    rounds would only hold memory (some 70 KB a session of 256 tokens) for as long as the
    daemon runs.

    The summary itself stays as long as the log: a verifier must never sign two different
    results for one (session, round), so a closed session's id is never opened again (a
    proposer's other drafts would make other rounds), and refusing it takes remembering it:
    about 350 bytes in memory and 140 in a snapshot a session."""

    session_id: bytes
    epoch: int
    rounds: int
    emitted: int
    done: bool
    genesis_head: bytes
    head: bytes

    @classmethod
    def of(cls, state: SessionState) -> SessionSummary:
        return cls(
            state.session_id,
            state.epoch,
            state.next_round,
            state.produced,
            state.done,
            state.open.genesis_head(),
            state.head,
        )

    def summary(self) -> dict:
        return {
            "session": self.session_id.hex(),
            "epoch": self.epoch,
            "rounds": self.rounds,
            "emitted": self.emitted,
            "done": self.done,
            "genesis_head": self.genesis_head.hex(),
            "head": self.head.hex(),
        }


class Replay:
    """Applies entries in order; raises JournalError at the first one that does not fit.

    With `verifier_keys`, every ROUND signature must verify under the key it names; with
    `proposer_keys`, every OPEN signature too.
    """

    def __init__(
        self,
        verifier_keys: Mapping[str, Ed25519PublicKey] | None = None,
        proposer_keys: Mapping[str, Ed25519PublicKey] | None = None,
    ) -> None:
        self.sessions: dict[bytes, SessionState] = {}
        self.closed: dict[bytes, SessionSummary] = {}
        self.verifier_keys = verifier_keys
        self.proposer_keys = proposer_keys

    def session(self, session_id: bytes, what: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None:
            closed = "closed" if session_id in self.closed else "never opened"
            raise JournalError(f"{what} for session {session_id.hex()}, which is {closed}")
        return state

    def apply(self, entry: Entry) -> SessionState:
        if isinstance(entry, OpenEntry):
            return self._open(entry)
        if isinstance(entry, RoundEntry):
            signed, result = entry.decode()
            state = self.session(result.session_id, f"ROUND {result.round}")
            if self.verifier_keys is not None:
                check_signature(self.verifier_keys, result.verifier_key_id, signed, "result")
            post = state.check_round(result, entry.request_digest)
            state.apply_round(result, entry.request_digest, entry.signed, post)
            return state
        if isinstance(entry, ResumeEntry):
            return self._resume(entry)
        if isinstance(entry, EpochEntry):
            state = self.session(entry.session_id, "EPOCH")
            if entry.epoch <= state.epoch:
                raise JournalError(
                    f"EPOCH {entry.epoch} for session {short(entry.session_id)} does not raise "
                    f"its epoch {state.epoch}"
                )
            state.epoch = entry.epoch
            return state
        state = self.session(entry.session_id, "CLOSE")
        self.closed[entry.session_id] = SessionSummary.of(self.sessions.pop(entry.session_id))
        return state

    def _open(self, entry: OpenEntry) -> SessionState:
        sid = entry.open.session_id
        if sid in self.sessions or sid in self.closed:
            raise JournalError(f"OPEN of session {sid.hex()}, which was opened before")
        if sha256(tokens_bytes(entry.prompt)) != entry.open.prompt_digest:
            raise JournalError(f"OPEN of session {sid.hex()}: prompt does not hash to its digest")
        if not entry.prompt:
            raise JournalError(f"OPEN of session {sid.hex()}: empty prompt")
        if self.proposer_keys is not None:
            signed = Signed(entry.open.signed_message(entry.epoch), entry.signature)
            check_signature(self.proposer_keys, entry.open.proposer_key_id, signed, "open")
        state = SessionState.fresh(entry)
        self.sessions[sid] = state
        return state

    def _resume(self, entry: ResumeEntry) -> SessionState:
        sid = entry.open.session_id
        what = f"RESUME of session {sid.hex()}"
        if sid in self.closed:
            raise JournalError(f"{what}, which was closed")
        if sha256(tokens_bytes(entry.prompt)) != entry.open.prompt_digest:
            raise JournalError(f"{what}: prompt does not hash to its digest")
        held = self.sessions.get(sid)
        if held is not None and held.open.encode() != entry.open.encode():
            raise JournalError(f"{what}: another open than the session's")
        if held is not None and entry.epoch < held.epoch:
            raise JournalError(f"{what} at epoch {entry.epoch}, below its epoch {held.epoch}")
        if self.proposer_keys is not None:
            signed = Signed(entry.open.signed_message(entry.epoch, entry.resume), entry.signature)
            check_signature(self.proposer_keys, entry.open.proposer_key_id, signed, "resume")
        try:
            state = SessionState.resumed(entry, self.verifier_keys)
        except RefusedError as exc:
            raise JournalError(f"{what}: {exc}") from exc
        self.sessions[sid] = state
        return state


def check_signature(
    known: Mapping[str, Ed25519PublicKey], key_id: str, signed: Signed, what: str
) -> None:
    public = known.get(key_id)
    if public is None:
        raise JournalError(f"{what} signed by key {key_id!r}, not one of {sorted(known)}")
    try:
        keys.verify(public, signed.body, signed.signature, what)
    except keys.SignatureError as exc:
        raise JournalError(str(exc)) from exc


# --- the interpreter for `muser wal inspect / verify` -----------------------------------------


def describe(payload: bytes) -> dict:
    """A JSON-able description of one entry."""
    entry = decode(payload)
    if isinstance(entry, OpenEntry):
        return {
            "entry": "open",
            "session": entry.open.session_id.hex(),
            "epoch": entry.epoch,
            "prompt_tokens": len(entry.prompt),
            "proposer_key_id": entry.open.proposer_key_id,
            "genesis_head": entry.open.genesis_head().hex(),
        }
    if isinstance(entry, RoundEntry):
        _, result = entry.decode()
        return {
            "entry": "round",
            "session": result.session_id.hex(),
            "round": result.round,
            "epoch": result.epoch,
            "drafts": len(result.drafts),
            "accepted": result.accepted,
            "next_frontier": result.next_frontier,
            "prev_head": result.prev_head.hex(),
            "head": result.head.hex(),
            "verifier_key_id": result.verifier_key_id,
        }
    if isinstance(entry, EpochEntry):
        return {"entry": "epoch", "session": entry.session_id.hex(), "epoch": entry.epoch}
    if isinstance(entry, ResumeEntry):
        result = RoundResult.decode(Signed.decode(entry.resume).body)
        return {
            "entry": "resume",
            "session": entry.open.session_id.hex(),
            "epoch": entry.epoch,
            "after_round": result.round,
            "head": result.head.hex(),
            "signed_by": result.verifier_key_id,
            "prompt_tokens": len(entry.prompt),
            "generated_tokens": len(entry.generated),
        }
    return {"entry": "close", "session": entry.session_id.hex()}


@dataclass(frozen=True)
class BadRecord:
    seq: int
    reason: str
    snapshot: bool = False
    """The snapshot at `seq` does not replay (not the record at `seq`)."""

    def __str__(self) -> str:
        return f"{'snapshot at seq' if self.snapshot else 'seq'} {self.seq}: {self.reason}"


@dataclass
class JournalReport:
    records: int
    sessions: list[dict]
    first_bad: BadRecord | None

    @property
    def ok(self) -> bool:
        return self.first_bad is None


class VerifierJournal:
    """Interprets a verifier commit log: shows sessions and heads, checks every round's hash
    chain and, given public keys, every signature."""

    name = "verifier"
    domain = DOMAIN

    def matches(self, payload: bytes) -> bool:
        try:
            Reader(payload, DOMAIN)
        except CanonicalError:
            return False
        return True

    def describe(self, payload: bytes) -> dict:
        return describe(payload)

    def verify(
        self,
        records: Iterable[tuple[int, bytes]],
        *,
        verifier_keys: Mapping[str, Ed25519PublicKey] | None = None,
        proposer_keys: Mapping[str, Ed25519PublicKey] | None = None,
        snapshot: Snapshot | None = None,
    ) -> JournalReport:
        """Replay (seq, payload) records, after `snapshot` when the log was compacted
        (verifier_gx.compaction; the records it covers are skipped); stop at the first that
        does not fit."""
        from verifier_gx.compaction import replay_from_snapshot

        replay, floor, count, bad = Replay(verifier_keys, proposer_keys), 0, 0, None
        if snapshot is not None:
            floor = snapshot.seq
            try:
                replay = replay_from_snapshot(snapshot.data, verifier_keys, proposer_keys)
            except (CanonicalError, JournalError) as exc:
                return JournalReport(0, [], BadRecord(floor, str(exc), snapshot=True))
        for seq, payload in records:
            if seq <= floor:
                continue  # covered by the snapshot (kept until the next one drops it)
            count += 1
            try:
                replay.apply(decode(payload))
            except (CanonicalError, JournalError) as exc:
                bad = BadRecord(seq, str(exc))
                break
        states = [*replay.sessions.values(), *replay.closed.values()]
        sessions = [
            dict(s.summary(), closed=s.session_id in replay.closed)
            for s in sorted(states, key=lambda s: s.session_id)
        ]
        return JournalReport(count, sessions, bad)


class WalInterpreter:
    """`wal.interpret` adapter: `muser wal inspect/verify` on a verifier commit log.

    Given --pubkey files, every round result's signature must verify under the enrolled key
    it names (a result naming a key that was not given is a failure)."""

    name = "verifier-journal"

    def describe(self, payload: bytes) -> dict | None:
        try:
            return describe(payload)
        except (CanonicalError, JournalError, ValueError):
            return None

    def check_chain(self, records, pubkeys, snapshot) -> str | None:
        from muser.walkeys import keys_by_id
        from verifier_gx.compaction import SNAPSHOT_DOMAIN

        if snapshot is not None and domain_of(snapshot.data) not in (SNAPSHOT_DOMAIN, None):
            snapshot = None  # another daemon's (its interpreter checks it)
        mine = [(r.seq, r.payload) for r in records if VerifierJournal().matches(r.payload)]
        if not mine and snapshot is None:
            return None
        keys = keys_by_id(pubkeys) if pubkeys else None
        report = VerifierJournal().verify(mine, verifier_keys=keys, snapshot=snapshot)
        return None if report.first_bad is None else str(report.first_bad)
