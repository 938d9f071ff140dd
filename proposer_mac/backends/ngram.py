"""A model-free n-gram draft: prompt lookup (docs/design.md §9), as vLLM's `ngram` proposer,
llama.cpp's lookup decoding and transformers' `prompt_lookup_num_tokens` do it.

After each token the draft looks for an earlier occurrence of the sequence's last n tokens,
for n from `max_n` down to `min_n`, and proposes the token that followed the most recent such
occurrence (`muser.lookup.PromptLookup`, the index the verifier also reads to end a decode
round where this draft would propose: `verifier_gx.decode`). Drafting a chain feeds each
proposal back in, so a chain follows one earlier passage for as long as it keeps matching.
The defaults (2..3) measured best on the real pair's held-out prompts: a 1-token match
proposes too often and is rejected too often, and on a CPU every rejected position costs a
quarter of a decode (docs/benchmarks.md).

What q is. The draft speaks the backend contract (`muser.backend`): its row after a token is
raw logits, 0 at the proposed token and -inf everywhere else. Every transform the session
applies (temperature, top-k, top-p) keeps that row one-hot, so at any temperature
q = δ(x) for the proposal x. The exact round then accepts x with probability
min(1, p(x)/q(x)) = p(x) and, on rejection, samples the residual norm(max(p − δ(x), 0)),
which is p with x removed and renormalised: the emitted token is distributed as p, the
same argument as for any q (docs/design.md §2). At temperature 0 the verifier accepts x iff it is
the target's argmax.

No match means no proposal: the row is -inf everywhere, and the drafter ends the round's
draft there (a round may draft fewer than D tokens, or none: then the verifier decodes).

Trees (docs/design.md §3). A token tree's q row at a position is `candidates`: the tokens that
followed every earlier occurrence of the position's suffix, the longest matching n first and
the most recent first, each occurrence weighing half the one before it (an occurrence found
for several n counts once, at its longest). So the heaviest token is always the chain's
proposal, a tree's first branch is the chain, and its other children are the passages the
chain passed over. The weights are the q the children are drawn from (without replacement
at T > 0, the largest at T = 0) and judged against: lossless for any q, as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity
from muser.geometry import check_rollback, check_room, check_tokens, read_geometry
from muser.identity import NGRAM_MAX_N, NGRAM_MIN_N, model_identity, ngram_identity
from muser.lookup import PromptLookup
from muser.sampling import SparseRow

CANDIDATE_OCCURRENCES = 16
"""Earlier occurrences a tree row reads at most (the 17th would weigh 2^-16 of the first)."""


def no_proposal(row: np.ndarray) -> bool:
    """True for a draft row that proposes nothing (every logit -inf)."""
    return not np.isfinite(row).any()


class NgramDraft(HeldTokens):
    """Prompt lookup over the session's own tokens; `path` is the target's checkpoint, whose
    tokenizer, vocabulary and context window it shares (nothing else is read)."""

    label = "ngram"

    def __init__(
        self,
        path: str | Path,
        *,
        min_n: int = NGRAM_MIN_N,
        max_n: int = NGRAM_MAX_N,
        context_length: int | None = None,
    ) -> None:
        self._setup(
            model_identity(path), read_geometry(path, context_length=context_length), min_n, max_n
        )

    @classmethod
    def over(
        cls,
        target: ModelIdentity,
        geometry: Geometry,
        min_n: int = NGRAM_MIN_N,
        max_n: int = NGRAM_MAX_N,
    ) -> NgramDraft:
        """The draft for a target known by its identity and geometry (no files read)."""
        draft = object.__new__(cls)
        draft._setup(target, geometry, min_n, max_n)
        return draft

    def _setup(self, target: ModelIdentity, geometry: Geometry, min_n: int, max_n: int) -> None:
        self._lookup = PromptLookup(min_n, max_n)
        self.min_n, self.max_n = self._lookup.min_n, self._lookup.max_n
        self.identity = ngram_identity(target, min_n, max_n)
        self.geometry = geometry
        self.device = "cpu"

    @property
    def _tokens(self) -> list[int]:
        return self._lookup.tokens

    @property
    def _ends(self) -> list[dict[tuple[int, ...], list[int]]]:
        return self._lookup.ends

    def proposal(self) -> int | None:
        """The token after the most recent earlier occurrence of the longest matching suffix."""
        return self._lookup.proposal()

    def candidates(
        self, after: Sequence[int] = (), limit: int = CANDIDATE_OCCURRENCES
    ) -> SparseRow:
        """The q row of a tree position (module note) after the held tokens and `after`
        (pushed and popped again): at most `limit` occurrences; no ids when nothing
        matches."""
        for token in after:
            self._push(int(token))
        try:
            seq, length = self._tokens, len(self._tokens)
            weights: dict[int, float] = {}
            seen: set[int] = set()
            weight = 1.0
            for n in range(min(self.max_n, length), self.min_n - 1, -1):
                ends = self._ends[n].get(tuple(seq[length - n :]), [])
                for end in reversed(ends[:-1]):  # ends[-1] is the suffix itself
                    if end in seen or len(seen) >= limit:
                        continue
                    seen.add(end)
                    weights[seq[end]] = weights.get(seq[end], 0.0) + weight
                    weight /= 2
        finally:
            for _ in after:
                self._pop()
        ids = np.array(sorted(weights), dtype=np.int64)
        return SparseRow(ids, np.array([weights[int(i)] for i in ids], dtype=np.float64))

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; row i proposes the token after tokens[i] (or nothing)."""
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        rows = np.full((len(ids), self.vocab_size), -np.inf)
        for i, token in enumerate(ids):
            self._push(token)
            proposal = self.proposal()
            if proposal is not None:
                rows[i, proposal] = 0.0
        return rows

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens (refuses n < 0 or n > length)."""
        check_rollback(n, self.length)
        for _ in range(n):
            self._pop()

    def reset(self) -> None:
        self.rollback(self.length)

    def fork(self) -> NgramDraft:
        """An empty sequence with the same settings (each session drafts on its own)."""
        twin = object.__new__(NgramDraft)
        twin.__dict__.update(self.__dict__)
        twin._lookup = PromptLookup(self.min_n, self.max_n)
        return twin

    def _push(self, token: int) -> None:
        self._lookup.push(token)

    def _pop(self) -> None:
        self._lookup.pop()
