"""The target side of a round: witness rows for [frontier, drafts], then settle the KV.

The executor keeps the target's KV equal to the transcript minus the frontier; a round
appends [f, d_0..d_D-1], and `settle` keeps f and the accepted drafts (a + 1 tokens).

`witness_batch` serves the rounds of several sessions at once: each executor first holds its
transcript minus the frontier (a session whose KV was evicted re-evaluates it here), then
every round's [f, drafts] goes through one forward when the backend batches sequences
(`muser.backend.MultiSequenceBackend`), one after another otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muser.backend import ModelBackend, evaluate_batch
from muser.cursor import KvCursor


class TargetExecutor:
    def __init__(self, backend: ModelBackend) -> None:
        self.cursor = KvCursor(backend)

    def witness_logits(self, transcript: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """Raw logits (D+1, V) for [frontier, *drafts] after transcript[:-1]."""
        self.cursor.hold(transcript[:-1])
        return self.cursor.extend([transcript[-1], *drafts])

    def prepare(self, transcript: Sequence[int], drafts: Sequence[int]) -> tuple[int, list[int]]:
        """Hold transcript[:-1]; return (tokens re-evaluated to get there, the round's tokens
        [frontier, *drafts] still to evaluate)."""
        kept = transcript[:-1]
        reused = self.cursor.reusable(kept)
        self.cursor.hold(kept)
        return len(kept) - reused, [int(transcript[-1]), *(int(d) for d in drafts)]

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
