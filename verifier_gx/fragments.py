"""Fragments staged on the verifier: content-addressed bytes a round may name (DESIGN.md §6).

Held in memory and hash-checked on the way in. A fragment is staged under an owner
(session, round): the round it arrived for, or the round whose capture rows it carries.
The proposer's ack of round r releases everything staged for rounds <= r of that session;
closing a session releases all of its fragments. Losing them in a restart is harmless:
a request that names a fragment the verifier no longer holds is answered with
`missing_fragments`, and the proposer sends it again.
"""

from __future__ import annotations

from muser.errors import FragmentHashMismatchError
from muser.records import sha256

Owner = tuple[bytes, int]


class FragmentStage:
    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._owners: dict[bytes, set[Owner]] = {}

    @staticmethod
    def check(digest: bytes, data: bytes) -> None:
        actual = sha256(data)
        if actual != digest:
            raise FragmentHashMismatchError(
                f"fragment named {digest.hex()} holds {len(data)} bytes hashing to {actual.hex()}"
            )

    def put(self, digest: bytes, data: bytes, owner: Owner) -> bool:
        """Stage `data`; True when it was new (duplicates are absorbed)."""
        self.check(digest, data)
        new = digest not in self._data
        self._data.setdefault(digest, data)
        self._owners.setdefault(digest, set()).add(owner)
        return new

    def get(self, digest: bytes) -> bytes | None:
        return self._data.get(digest)

    def release(self, session_id: bytes, upto_round: int) -> int:
        """Drop this session's claims on rounds <= upto_round; returns fragments freed."""
        return self._drop(lambda o: o[0] == session_id and o[1] <= upto_round)

    def drop_session(self, session_id: bytes) -> int:
        return self._drop(lambda o: o[0] == session_id)

    def _drop(self, doomed) -> int:
        freed = 0
        for digest in list(self._owners):
            owners = {o for o in self._owners[digest] if not doomed(o)}
            if owners:
                self._owners[digest] = owners
            else:
                del self._owners[digest], self._data[digest]
                freed += 1
        return freed

    def __len__(self) -> int:
        return len(self._data)

    @property
    def bytes_held(self) -> int:
        return sum(len(d) for d in self._data.values())
