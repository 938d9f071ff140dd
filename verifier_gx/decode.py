"""Verifier-side decode: a round without drafts that emits several tokens.

When drafting does not pay, the proposer sends rounds with no drafts and `decode_len` = k:
the target samples k tokens itself, each from its own row with one draw of the session's
MT19937 stream (none when greedy), stopping early after a stop token. That is exactly k
singleton rounds (DESIGN.md §4, D = 0) back to back — the same target rows, the same draws, the same tokens — so
the wire, the WAL commit and the signatures are paid once per k tokens instead of once per
token, and the local lane (which runs the same function) emits the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, target_probs
from muser.verify import RoundDecision, judge_round
from verifier_gx.executor import TargetExecutor


@dataclass(frozen=True)
class Decoded:
    tokens: list[int]
    """The tokens sampled, the last one the round's next frontier."""
    post_state: Mt19937
    logits: np.ndarray
    """The target's raw logits row each token was sampled from, shape (len(tokens), V)."""


def decode_round(
    executor: TargetExecutor,
    transcript: Sequence[int],
    state: Mt19937,
    decode_len: int,
    params: SamplingParams,
) -> Decoded:
    """Sample up to `decode_len` tokens after `transcript` (which ends with the frontier): each
    step is a singleton round (DESIGN.md §4) judged by `judge_round`, its KV settled."""
    if decode_len < 1:
        raise ValueError(f"decode_len must be >= 1, got {decode_len}")
    sequence = [int(t) for t in transcript]
    rng, tokens, rows = state, [], []
    for _ in range(decode_len):
        logits = executor.witness_logits(sequence, [])
        decision = judge_round(
            rng, sequence[-1], [], [], target_probs(logits, params), greedy=params.greedy
        )
        executor.settle(len(sequence), 0)
        rng = decision.post_state
        tokens.append(decision.next_frontier)
        sequence.append(decision.next_frontier)
        rows.append(logits[0])
        if decision.next_frontier in params.stop_tokens:
            break
    return Decoded(tokens, rng, np.stack(rows))


def decode_decision(decoded: Decoded, state: Mt19937) -> RoundDecision:
    """A decode round as the decision the result records: no drafts, the sampled tokens
    before the last, the last as next frontier."""
    draws = decoded.post_state.draws - state.draws
    return RoundDecision(
        0, decoded.tokens[-1], decoded.post_state, draws, tuple(decoded.tokens[:-1])
    )
