"""Round geometry, the carried frontier and the draft row's default width (docs/design.md §2),
shared by every lane.

A session's transcript is the prompt followed by every emitted token; its last token is the
frontier (the last prompt token at genesis). The target's KV covers the transcript minus the
frontier; a round evaluates [frontier, d_0, ..., d_D-1] and emits a + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from muser.errors import RefusedError

DEFAULT_Q_TOP_K = 2048
"""The default width of a draft row: the whole row for vocabularies up to 2,048 tokens, the
most probable 2,048 tokens above that. A narrower row is smaller on the wire but accepts
less at T > 0: the verifier accepts a draft with probability sum(min(p, q)) over the row as
sent, and the mass the draft puts outside the row is lost. On the fixture pair at T=1, 32
entries accepted 25% of drafts and the whole row 70% (docs/benchmarks.md, sixth session).
Greedy rows are one-hot whatever the width."""


def plan_depth(draft_len: int, remaining: int) -> int:
    """Drafts for the next round: never more than can still be emitted (a round emits up to
    D + 1 tokens), so no lane ever overshoots max_tokens."""
    if remaining < 1:
        raise RefusedError(f"no tokens remain to emit (remaining={remaining})")
    return max(0, min(draft_len, remaining - 1))


@dataclass(frozen=True)
class Emission:
    tokens: list[int]
    """Tokens to hand to the client from this round."""
    done: bool
    """True once max_tokens is reached or a stop token was emitted."""


def clip_emission(
    emitted: Sequence[int], produced_so_far: int, max_tokens: int, stop_tokens: Sequence[int]
) -> Emission:
    """Cut a round's emission at the first stop token (kept) and at max_tokens."""
    room = max_tokens - produced_so_far
    out: list[int] = []
    for token in emitted[:room]:
        out.append(int(token))
        if token in stop_tokens:
            return Emission(out, True)
    return Emission(out, produced_so_far + len(out) >= max_tokens)
