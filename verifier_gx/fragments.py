"""Fragments staged on the verifier: content-addressed bytes a round may name (docs/design.md §7).

Held in memory and hash-checked on the way in. A fragment is staged under an owner
(session, round): the round it arrived for, or the round whose capture rows it carries.
The proposer's ack of round r releases everything staged for rounds <= r of that session;
closing a session releases all of its fragments.

Backed by a durable store (`wal.fragments.FileFragmentStore`, under the verifier's wal_dir):
every fragment a proposer sends is also written there, off the event loop, and a digest the
memory stage lacks is looked up there (re-hashed on read; a corrupt copy is quarantined and
counts as missing). So after a restart the verifier still holds what proposers sent, and a
proposer sends digests, not bytes, for it. The store is a cache, never trusted unchecked:
a fragment it lost (a crash before its write, a full disk) is answered with
`missing_fragments` and the proposer sends it again. It is collected down to what open
sessions' committed records name and what is staged (`live`), after its grace period
(`SessionManager.collect_fragments`, as sessions close).

What a proposer sends is counted per session (`held_by`: each fragment's bytes plus
OVERHEAD, once per session however often it comes), so the verifier can bound what one
session keeps staged (`SessionManager.put_fragment`); capture fragments, the verifier's own,
are not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from muser.errors import FragmentHashMismatchError
from muser.records import sha256
from wal.errors import FragmentCorruptError, FragmentMissingError, WalError
from wal.fragments import FileFragmentStore, MemoryFragmentStore

log = logging.getLogger("muser.verifier")

Owner = tuple[bytes, int]

OVERHEAD = 64
"""Bytes a staged fragment is charged beyond its data (its digest and bookkeeping), so that
a flood of tiny fragments is bounded too."""


class FragmentStage:
    def __init__(self, store: FileFragmentStore | MemoryFragmentStore | None = None) -> None:
        self.store = store
        """The durable store behind the stage (None: memory only)."""
        self._data: dict[bytes, bytes] = {}
        self._owners: dict[bytes, set[Owner]] = {}
        self._counted: set[tuple[bytes, bytes]] = set()  # (digest, session) charged
        self._held: dict[bytes, int] = {}  # session: bytes charged to it

    @staticmethod
    def check(digest: bytes, data: bytes) -> None:
        actual = sha256(data)
        if actual != digest:
            raise FragmentHashMismatchError(
                f"fragment named {digest.hex()} holds {len(data)} bytes hashing to {actual.hex()}"
            )

    def put(self, digest: bytes, data: bytes, owner: Owner, counted: bool = True) -> bool:
        """Stage `data`; True when it was new (duplicates are absorbed). `counted`: charged
        to the owner's session (`held_by`)."""
        self.check(digest, data)
        new = digest not in self._data
        self._data.setdefault(digest, data)
        self._owners.setdefault(digest, set()).add(owner)
        if counted and (digest, owner[0]) not in self._counted:
            self._counted.add((digest, owner[0]))
            self._held[owner[0]] = self.held_by(owner[0]) + len(data) + OVERHEAD
        return new

    def held_by(self, session_id: bytes) -> int:
        """Bytes the session's counted fragments are charged, until acked or closed."""
        return self._held.get(session_id, 0)

    def get(self, digest: bytes) -> bytes | None:
        """The bytes staged, else stored (hash-checked on read), else None."""
        data = self._data.get(digest)
        if data is None and self.store is not None and len(digest) == 32:
            try:
                data = self.store.get(digest.hex())
            except (FragmentMissingError, FragmentCorruptError):
                return None  # (a corrupt copy went to quarantine: re-requested, then healed)
            except WalError as exc:
                log.warning("fragment store read of %s failed: %s", digest.hex()[:16], exc)
                return None
        return data

    def keep(self, data: bytes) -> None:
        """Write `data` to the durable store (a worker thread's call: it fsyncs). A failure
        is logged, never raised: the store only saves a proposer resending."""
        if self.store is None:
            return
        try:
            self.store.put(data)
        except (WalError, OSError) as exc:
            log.warning("fragment store write failed (the fragment stays in memory): %s", exc)

    def live(self, named: Iterable[bytes]) -> set[str]:
        """What the store must keep (hex digests): `named` (what open sessions' committed
        records name) and everything staged."""
        return {d.hex() for d in named} | {d.hex() for d in self._data}

    @property
    def stored(self) -> int:
        """Fragments in the durable store (0 without one)."""
        return len(self.store.digests()) if self.store is not None else 0

    def release(self, session_id: bytes, upto_round: int) -> int:
        """Drop this session's claims on rounds <= upto_round; returns fragments freed."""
        return self._drop(lambda o: o[0] == session_id and o[1] <= upto_round)

    def drop_session(self, session_id: bytes) -> int:
        return self._drop(lambda o: o[0] == session_id)

    def _drop(self, doomed) -> int:
        freed = 0
        for digest in list(self._owners):
            owners = {o for o in self._owners[digest] if not doomed(o)}
            for sid in {o[0] for o in self._owners[digest]} - {o[0] for o in owners}:
                self._uncount(digest, sid)
            if owners:
                self._owners[digest] = owners
            else:
                del self._owners[digest], self._data[digest]
                freed += 1
        return freed

    def _uncount(self, digest: bytes, session_id: bytes) -> None:
        if (digest, session_id) in self._counted:
            self._counted.discard((digest, session_id))
            left = self._held[session_id] - len(self._data[digest]) - OVERHEAD
            if left:
                self._held[session_id] = left
            else:
                del self._held[session_id]

    def __len__(self) -> int:
        return len(self._data)

    @property
    def bytes_held(self) -> int:
        return sum(len(d) for d in self._data.values())
