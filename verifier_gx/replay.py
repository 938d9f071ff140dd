"""The session state the verifier's commit-log entries replay to (`Replay`, `SessionState`),
with the checks each entry must pass (format and rules: `verifier_gx.journal`). Daemon
recovery and `muser wal verify` run this same code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys
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
    sha256,
    state_digest,
    tokens_bytes,
    transcript_digest,
)
from muser.round import clip_emission
from muser.sampling import SamplingParams
from verifier_gx.journal import (
    Entry,
    EpochEntry,
    OpenEntry,
    ResumeEntry,
    RoundEntry,
    short,
)


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
    capture_from: int = 0
    """The first position whose capture rows the proposer has not been sent since the session
    was last opened here (muser.capture): 0 after every open, the next frontier's position
    after each round. Not durable: an open after a restart starts again from 0."""

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
        if result.is_tree and (result.decoded or result.accepted != len(result.path)):
            raise JournalError(
                f"{where}: a tree round accepts {result.accepted} nodes along "
                f"path {list(result.path)} and decodes {list(result.decoded)}"
            )
        try:
            post = advance(self.mt, result.draws(self.params.greedy))
        except RefusedError as exc:  # a path that is not one of its topology
            raise JournalError(f"{where}: {exc}") from exc
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
