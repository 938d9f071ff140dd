"""The verifier commit log's interpreter for `muser wal inspect/verify` (wal/interpret.py):
describes each entry, and replays the whole log (after its snapshot, when compacted) through
`verifier_gx.replay` to check every hash link and, given keys, every signature."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser.canonical import CanonicalError, Reader, domain_of
from muser.errors import (
    JournalError,
)
from muser.records import (
    RoundResult,
    Signed,
)
from verifier_gx.compaction import SNAPSHOT_DOMAIN, replay_from_snapshot
from verifier_gx.journal import (
    DOMAIN,
    EpochEntry,
    OpenEntry,
    ResumeEntry,
    RoundEntry,
    decode,
)
from verifier_gx.replay import Replay
from wal.base import Snapshot

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

        if snapshot is not None and domain_of(snapshot.data) not in (SNAPSHOT_DOMAIN, None):
            snapshot = None  # another daemon's (its interpreter checks it)
        mine = [(r.seq, r.payload) for r in records if VerifierJournal().matches(r.payload)]
        if not mine and snapshot is None:
            return None
        keys = keys_by_id(pubkeys) if pubkeys else None
        report = VerifierJournal().verify(mine, verifier_keys=keys, snapshot=snapshot)
        return None if report.first_bad is None else str(report.first_bad)
