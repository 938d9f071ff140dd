"""The target side of a round: witness rows for [frontier, drafts], then settle the KV.

The executor keeps the target's KV equal to the transcript minus the frontier; a round
appends [f, d_0..d_D-1], and `settle` keeps f and the accepted drafts (a + 1 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muser.backend import ModelBackend
from muser.cursor import KvCursor


class TargetExecutor:
    def __init__(self, backend: ModelBackend) -> None:
        self.cursor = KvCursor(backend)

    def witness_logits(self, transcript: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """Raw logits (D+1, V) for [frontier, *drafts] after transcript[:-1]."""
        self.cursor.hold(transcript[:-1])
        return self.cursor.extend([transcript[-1], *drafts])

    def settle(self, transcript_len: int, accepted: int) -> None:
        """Keep the KV of the frontier and the accepted drafts; drop the rest."""
        self.cursor.truncate(transcript_len + accepted)
