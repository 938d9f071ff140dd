"""Drafting one round on the proposer (DESIGN.md §4, draw order step 1).

The drafter keeps its backend's KV equal to the transcript through a `KvCursor`; a round
samples D tokens from sparse top-k rows with one draw each from a copy of the pre-round MT
state, exactly what the verifier will replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from muser.backend import ModelBackend
from muser.cursor import KvCursor
from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, SparseRow, argmax_lowest, draft_row, sample_ordered


@dataclass(frozen=True)
class Draft:
    drafts: list[int]
    q_rows: list[SparseRow]


class Drafter:
    def __init__(self, backend: ModelBackend, params: SamplingParams, q_top_k: int = 32) -> None:
        self.cursor = KvCursor(backend)
        self.params = params
        self.q_top_k = q_top_k

    def draft(self, transcript: Sequence[int], state: Mt19937, depth: int) -> Draft:
        """Draft `depth` tokens after `transcript` (which ends with the frontier)."""
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
                row = self.cursor.extend([token])[-1]
        return Draft(drafts, q_rows)
