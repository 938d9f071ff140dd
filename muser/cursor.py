"""A KV cursor: keeps a backend's cache equal to a token list by rollback and extension.

Both the drafter and the target executor work on transcripts that grow by whole rounds and
shrink when drafts are rejected. `sync(tokens)` rolls the cache back to the longest common
prefix with `tokens` and evaluates the rest, so neither side re-evaluates what it holds.
Rollback is explicit and checked by the backend (STYLE.md item 6).

Several cursors may share one backend (one model, many sessions): the backend remembers
which cursor last shaped its cache, and a cursor that finds another owner resets the cache
and rebuilds from its own tokens — correct always, and cheap when sessions don't interleave.
The backend remembers its cursor by a weak reference: a sequence and its cursor would
otherwise hold each other, a cycle only the garbage collector's rare full pass frees, and a
daemon kept every finished session's KV until then (issue 35's soak: 2 MB a session).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from muser.backend import ModelBackend


def owner(backend: object) -> KvCursor | None:
    """The cursor that last shaped `backend`'s cache, while it lives; None otherwise."""
    ref = getattr(backend, "_muser_cursor", None)
    return ref() if ref is not None else None


def set_owner(backend: object, cursor: KvCursor) -> None:
    """Note `cursor` as the one that shaped `backend`'s cache (weakly: see the module
    docstring)."""
    backend._muser_cursor = weakref.ref(cursor)  # type: ignore[attr-defined]


class KvCursor:
    def __init__(self, backend: ModelBackend) -> None:
        self.backend = backend
        self.tokens: list[int] = []
        self.last_row: np.ndarray | None = None
        """Logits after the last cached token (None when unknown, e.g. after a rollback)."""

    def claim(self) -> None:
        """Make the backend's cache this cursor's (reset, if another shaped it last)."""
        if owner(self.backend) is not self:
            self.backend.reset()
            self.tokens = []
            self.last_row = None
            set_owner(self.backend, self)

    def holds(self, tokens: Sequence[int]) -> bool:
        """True when the backend's cache is this cursor's and holds exactly `tokens`."""
        return owner(self.backend) is self and self.tokens == list(tokens)

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest common prefix of the cache's tokens and `tokens`. Every
        round asks this of a whole transcript, so the comparisons run in C: one list
        comparison when one holds the other's start (most rounds), else a bisection on
        prefix equality (a rejected draft, a new prompt), never a Python loop per token."""
        mine = self.tokens
        n = min(len(mine), len(tokens))
        theirs = list(tokens[:n])
        if mine[:n] == theirs:
            return n
        lo, hi = 0, n  # mine[:lo] == theirs[:lo], mine[:hi] != theirs[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if mine[lo:mid] == theirs[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def reusable(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the cache already holds for this cursor (what `hold`
        and `sync` will not re-evaluate)."""
        if owner(self.backend) is not self:
            return 0
        return self._common_prefix(tokens)

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        self.claim()
        drop = len(self.tokens) - length
        if drop > 0:
            self.backend.rollback(drop)
            del self.tokens[length:]
            self.last_row = None

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Evaluate `tokens` after the cache; returns their rows (n, V) float64."""
        if not tokens:
            return np.zeros((0, self.backend.vocab_size))
        self.claim()
        rows = self.backend.evaluate([int(t) for t in tokens])
        self.tokens.extend(int(t) for t in tokens)
        self.last_row = rows[-1]
        return rows

    def record(self, tokens: Sequence[int], rows: np.ndarray) -> None:
        """Note that `tokens` were evaluated after the cache outside this cursor (a batched
        forward, a capture) with `rows` their logits: the cursor then holds them too."""
        if owner(self.backend) is not self:
            raise ValueError("record() after another cursor shaped the cache; hold() first")
        if len(rows) != len(tokens):
            raise ValueError(f"{len(rows)} rows recorded for {len(tokens)} tokens")
        if tokens:
            self.tokens.extend(int(t) for t in tokens)
            self.last_row = rows[-1]

    def realign(self) -> None:
        """After an evaluate outside this cursor failed part-way (a batch that refused one
        of its sequences after appending others): drop the KV the backend holds beyond this
        cursor's tokens, so both agree again."""
        if owner(self.backend) is not self:
            return
        extra = self.backend.length - len(self.tokens)
        if extra > 0:
            self.backend.rollback(extra)
            self.last_row = None

    def hold(self, tokens: Sequence[int]) -> None:
        """Make the cache hold exactly `tokens` (possibly none); no row is needed."""
        self.claim()
        self.truncate(self._common_prefix(tokens))
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `tokens`; return the logits after the last one."""
        todo = self.prepare(tokens)
        return self.extend(todo)[-1] if todo else self.last_row

    def prepare(self, tokens: Sequence[int]) -> list[int]:
        """The first half of `sync`: roll back to what `tokens` shares with the cache and
        return the rest, to be evaluated here (`extend`) or in a batched forward (`record`).
        Empty when the cache holds `tokens` and `last_row` is their row."""
        if not tokens:
            raise ValueError("cannot sync a cursor to an empty token list")
        self.claim()
        common = self._common_prefix(tokens)
        if common == len(tokens) == len(self.tokens) and self.last_row is not None:
            return []
        if common == len(tokens):
            common -= 1  # the last row is needed: re-evaluate the last token
        self.truncate(common)
        return [int(t) for t in tokens[common:]]
