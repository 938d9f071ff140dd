"""Drafting one round on the proposer (DESIGN.md §4, draw order step 1), and drafting the
round after it before its result is known (latency hiding).

The drafter keeps its backend's KV equal to the transcript through a `KvCursor`; a round
samples D tokens from sparse top-k rows with one draw each from a copy of the pre-round MT
state, exactly what the verifier will replay.

Speculation: while round r is at the verifier, `speculate` drafts round r+1 on the guess
that r is fully accepted and that its bonus token is the one the draft itself would pick
with the same draw (the draw the verifier will use for the bonus is known: the stream is
replayable). The guess only decides *when* a draft is computed, never *what* it is: the
speculative draft runs the same cursor operations from the same checkpoint as a draft made
after the result, so on a hit it is bit-for-bit the draft the local lane makes, and on a
miss the cursor is put back to the checkpoint before drafting again. Exactness does not
depend on the guess.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from muser.backend import ModelBackend
from muser.cursor import KvCursor
from muser.mt19937 import Mt19937
from muser.records import advance, draws_for_round
from muser.sampling import SamplingParams, SparseRow, argmax_lowest, draft_row, sample_ordered


@dataclass(frozen=True)
class Draft:
    drafts: list[int]
    q_rows: list[SparseRow]


@dataclass(frozen=True)
class Speculation:
    """Round r+1 drafted on a guess about round r's outcome."""

    emitted: list[int]
    """What round r is guessed to emit: its drafts, all accepted, then the bonus guess."""
    depth: int
    proposal: Draft | None
    """None when the speculation was stopped or the guess ends the session."""


class Stopped(Exception):
    """A speculation was told to stop between two forwards."""


@dataclass
class _Checkpoint:
    length: int
    last_row: np.ndarray | None


class Drafter:
    def __init__(self, backend: ModelBackend, params: SamplingParams, q_top_k: int = 32) -> None:
        self.cursor = KvCursor(backend)
        self.params = params
        self.q_top_k = q_top_k
        self._checkpoint: _Checkpoint | None = None
        """Where the cursor stood after the last non-speculative draft, while a speculation
        may have moved it."""

    def draft(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        depth: int,
        stop: threading.Event | None = None,
    ) -> Draft:
        """Draft `depth` tokens after `transcript` (which ends with the frontier)."""
        self._restore()
        return self._draft(transcript, state, depth, stop)

    def _draft(
        self, transcript: Sequence[int], state: Mt19937, depth: int, stop: threading.Event | None
    ) -> Draft:
        if depth == 0:
            return Draft([], [])
        rng = state.copy()
        row = self.cursor.sync(transcript)
        drafts: list[int] = []
        q_rows: list[SparseRow] = []
        for i in range(depth):
            q = draft_row(row, self.params, self.q_top_k)
            if self.params.greedy:
                token = int(q.ids[argmax_lowest(q.weights)])
            else:
                token = int(q.ids[sample_ordered(q.weights, rng.uniform_f64())])
            drafts.append(token)
            q_rows.append(q)
            if i + 1 < depth:
                if stop is not None and stop.is_set():
                    raise Stopped
                row = self.cursor.extend([token])[-1]
        return Draft(drafts, q_rows)

    def speculate(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        current: Draft,
        next_depth: int,
        stop_tokens: Sequence[int],
        stop: threading.Event | None = None,
    ) -> Speculation | None:
        """Draft the round after `current` (just drafted from `transcript`, `state`) on the
        guess that it is fully accepted. Call right after `draft` returned `current`; None
        when the cursor no longer stands where that draft left it (another session drafted
        in between) or the round drafts nothing."""
        depth = len(current.drafts)
        held = [*transcript, *current.drafts[:-1]]
        if depth == 0 or not self.cursor.holds(held) or self.cursor.last_row is None:
            return None
        self._checkpoint = _Checkpoint(len(held), self.cursor.last_row)
        row = self.cursor.extend([current.drafts[-1]])[-1]
        q = draft_row(row, self.params, self.q_top_k)
        if self.params.greedy:
            bonus = int(q.ids[argmax_lowest(q.weights)])
        else:
            u = advance(state, 2 * depth).uniform_f64()  # the verifier's bonus draw
            bonus = int(q.ids[sample_ordered(q.weights, u)])
        emitted = [*current.drafts, bonus]
        if any(t in stop_tokens for t in emitted):
            return Speculation(emitted, next_depth, None)
        post = advance(state, draws_for_round(depth, depth, self.params.greedy))
        try:
            self._rewind()  # the draft below must start where a post-result draft starts
            proposal = self._draft([*transcript, *emitted], post, next_depth, stop)
        except Stopped:
            return Speculation(emitted, next_depth, None)
        return Speculation(emitted, next_depth, proposal)

    def adopt(self) -> None:
        """The guess held: the cursor already stands where the post-result draft left it."""
        self._checkpoint = None

    def _rewind(self) -> None:
        cp = self._checkpoint
        if cp is not None and len(self.cursor.tokens) >= cp.length:
            self.cursor.truncate(cp.length)
            self.cursor.last_row = cp.last_row

    def _restore(self) -> None:
        """Put the cursor back where the last real draft left it (after a missed guess)."""
        self._rewind()
        self._checkpoint = None
