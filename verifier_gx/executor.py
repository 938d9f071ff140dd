"""The target side of a round: witness rows for [frontier, drafts], then settle the KV.

The executor keeps the target's KV equal to the transcript minus the frontier; a round
appends [f, d_0..d_D-1], and `settle` keeps f and the accepted drafts (a + 1 tokens).

`witness_batch` serves the rounds of several sessions at once: each executor first holds its
transcript minus the frontier (a session whose KV was evicted re-evaluates it here), then
every round's [f, drafts] goes through one forward when the backend batches sequences
(`muser.backend.MultiSequenceBackend`), one after another otherwise.

Lookahead: before a round's request arrives, the proposer may name the tokens it drafted for
it (a `Lookahead` hint). `look_ahead` evaluates [f, drafts] after the transcript then, while
the request is still on its way (its PREPARED fsync, signature, admission); when the request
names the same tokens after the same transcript, `witness_batch` takes those rows instead of
a forward. They are the rows that forward would give: the same tokens on the same KV (a
batched forward may differ from a lone one in the last bits, as for any batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muser.backend import ModelBackend, evaluate_batch
from muser.cursor import KvCursor


class TargetExecutor:
    def __init__(self, backend: ModelBackend) -> None:
        self.cursor = KvCursor(backend)
        self._ahead: tuple[list[int], np.ndarray, float] | None = None
        """The last `look_ahead`: its tokens, their rows, the seconds its forward took."""
        self.ahead_s = 0.0
        """The forward seconds of the rows the last round took from a lookahead (0: none)."""

    def look_ahead(self, transcript: Sequence[int], drafts: Sequence[int], clock) -> float | None:
        """Evaluate the round [transcript[-1], *drafts] now, before its request: append the
        round's tokens after transcript[:-1], keeping their rows for `take_ahead`. Returns
        the forward's seconds (`clock` the caller's); None, and nothing evaluated, when the
        KV does not hold transcript[:-1] (a hint never rebuilds a KV: on a shared one that
        would take it from the session that holds it)."""
        self._ahead = None
        kept = transcript[:-1]
        if self.cursor.reusable(kept) != len(kept):
            return None
        tokens = [int(transcript[-1]), *(int(d) for d in drafts)]
        t0 = clock()
        self.cursor.hold(kept)  # drops what it holds past `kept` (nothing to evaluate)
        rows = self.cursor.extend(tokens)
        seconds = clock() - t0
        self._ahead = (tokens, rows, seconds)
        return seconds

    def take_ahead(self, transcript: Sequence[int], drafts: Sequence[int]) -> np.ndarray | None:
        """The rows `look_ahead` made for this very round (same tokens after the same
        transcript, and the KV still standing where it left it), their forward's seconds in
        `ahead_s`; None otherwise. Either way the lookahead is spent."""
        ahead, self._ahead, self.ahead_s = self._ahead, None, 0.0
        if ahead is None:
            return None
        tokens, rows, seconds = ahead
        if tokens != [int(transcript[-1]), *(int(d) for d in drafts)]:
            return None
        if not self.cursor.holds([*transcript[:-1], *tokens]):
            return None
        self.ahead_s = seconds
        return rows

    def witness_logits(self, transcript: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """Raw logits (D+1, V) for [frontier, *drafts] after transcript[:-1]."""
        if (rows := self.take_ahead(transcript, drafts)) is not None:
            return rows
        self.cursor.hold(transcript[:-1])
        return self.cursor.extend([transcript[-1], *drafts])

    def prepare(
        self, transcript: Sequence[int], drafts: Sequence[int], redo_from: int | None = None
    ) -> tuple[int, list[int]]:
        """Hold transcript[:-1]; return (tokens re-evaluated to get there, the round's tokens
        [frontier, *drafts] still to evaluate). `redo_from`: hold at most the first
        `redo_from` tokens instead, the rest of transcript[:-1] coming first in the tokens
        returned (a capturing round evaluates again what it must send rows of)."""
        kept = transcript[:-1]
        reused = self.cursor.reusable(kept)
        start = len(kept) if redo_from is None else min(reused, redo_from)
        self.cursor.hold(kept[:start])
        again = [int(t) for t in kept[start:]]
        return len(kept) - reused, [*again, int(transcript[-1]), *(int(d) for d in drafts)]

    def settle(self, transcript_len: int, accepted: int) -> None:
        """Keep the KV of the frontier and the accepted drafts; drop the rest."""
        self.cursor.truncate(transcript_len + accepted)


def witness_batch(
    backend: ModelBackend, rounds: Sequence[tuple[TargetExecutor, Sequence[int], Sequence[int]]]
) -> list[np.ndarray]:
    """Raw logits per (executor, transcript, drafts), as `witness_logits` returns them, in
    one forward of `backend` when it batches. Every executor must hold its own sequence of
    `backend` (or all share `backend` itself, which then runs them in turn)."""
    if not rounds:
        return []
    if any(ex.cursor.backend is backend for ex, _, _ in rounds):
        return [ex.witness_logits(t, d) for ex, t, d in rounds]
    ahead = [ex.take_ahead(t, d) for ex, t, d in rounds]
    if any(a is not None for a in ahead):  # those rows are made; the rest go in one forward
        rest = [r for r, a in zip(rounds, ahead, strict=True) if a is None]
        made = iter(witness_batch(backend, rest))
        return [a if a is not None else next(made) for a in ahead]
    work = [(ex.cursor.backend, ex.prepare(t, d)[1]) for ex, t, d in rounds]
    try:
        rows = evaluate_batch(backend, work)
    except Exception:  # a backend may have appended some sequences before it refused
        for ex, _, _ in rounds:
            ex.cursor.realign()
        raise
    for (ex, _, _), (_, tokens), r in zip(rounds, work, rows, strict=True):
        ex.cursor.record(tokens, r)
    return rows


def witness_each(
    backend: ModelBackend, rounds: Sequence[tuple[TargetExecutor, Sequence[int], Sequence[int]]]
) -> list[np.ndarray | Exception]:
    """`witness_batch`, but one round's failure does not fail the others: when the batch is
    refused, each round runs alone and a round that still fails gets its exception in its
    place."""
    try:
        return list(witness_batch(backend, rounds))
    except Exception:
        out: list[np.ndarray | Exception] = []
        for r in rounds:
            try:
                out.append(witness_batch(backend, [r])[0])
            except Exception as exc:
                out.append(exc)
        return out
