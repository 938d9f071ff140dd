"""The verifier's commit-log entries and their codec; they replay in `verifier_gx.replay` and
are checked offline (`muser wal verify/inspect`) by `verifier_gx.journal_check`.

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

from dataclasses import dataclass

from muser.canonical import CanonicalError, Reader, Writer
from muser.records import (
    RoundResult,
    SessionOpen,
    Signed,
)

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
