"""Judging one linear round (docs/design.md §2). Pure: rows and an MT state in, a decision out.

Glossary (the same words in the wire, the WAL, the metrics and the CLI):
  frontier f         target-selected token whose target KV row does not exist yet
  drafts d_0..d_D-1  tokens the proposer sampled from its sparse rows q_0..q_D-1
  witness rows       p_0..p_D: the target's full probability rows for [f, d_0, ..., d_D-1];
                     p_i judges d_i and p_D yields the bonus
  accepted a         in [0, D]
  next frontier f'   residual sample at a (a < D) or the bonus from p_D (a = D)

Draw order within a round, and nothing else consumes:
  1. proposer, drafting: one uniform per draft row, d_i = sample_ordered(q_i, u)
  2. verifier, judging i = 0..D-1: one uniform u; accept iff u < p_i(d_i) / q_i(d_i)
  3. verifier: one uniform to sample f' from norm(max(p_a - q_a, 0)) (or p_a when that
     residual is all zero, or p_D when every draft was accepted)
Greedy rounds draw nothing: rows are one-hot argmax and acceptance is equality.

`judge_round` is the fast path (numpy over the vocabulary, a Python loop over the D drafts
only); `judge_round_reference` is the slow float64 reference written as plain loops. Tests
hold them equal under the same draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from muser.errors import (
    DraftMismatchError,
    DraftZeroProbabilityError,
    RowCountError,
    RowWidthError,
    TokenOutOfVocabularyError,
)
from muser.mt19937 import Mt19937
from muser.sampling import SparseRow, argmax_lowest, check_probability_rows, sample_ordered


@dataclass(frozen=True)
class RoundDecision:
    accepted: int
    next_frontier: int
    post_state: Mt19937
    draws: int
    """uniform_f64 draws this round consumed (drafting replay + judging)."""
    decoded: tuple[int, ...] = ()
    """A decode round's tokens before its next frontier (verifier_gx/decode.py)."""

    def emitted(self, drafts: Sequence[int]) -> list[int]:
        """Tokens this round emits: the accepted drafts (or the decoded tokens), then the
        next frontier."""
        return [*(int(t) for t in drafts[: self.accepted]), *self.decoded, self.next_frontier]


def check_geometry(
    witness: np.ndarray,
    rows: int,
    what: str,
    vocab_size: int,
    tokens: Sequence[tuple[str, int]],
) -> None:
    """`rows` witness rows, each `vocab_size` wide, for `what` (e.g. "4 drafts"); every
    named token inside the vocabulary."""
    if witness.ndim != 2 or witness.shape[0] != rows:
        raise RowCountError(f"{what} need {rows} witness rows, got shape {tuple(witness.shape)}")
    if witness.shape[1] != vocab_size:
        raise RowWidthError(
            f"witness rows must be {vocab_size} wide (the vocabulary), got {witness.shape[1]}"
        )
    for name, token in tokens:
        if not 0 <= int(token) < vocab_size:
            raise TokenOutOfVocabularyError(
                f"{name} token {int(token)} outside the vocabulary [0, {vocab_size})"
            )


def validate_round(
    frontier: int,
    drafts: Sequence[int],
    q_rows: Sequence[SparseRow],
    witness: np.ndarray,
    vocab_size: int,
) -> None:
    """Every geometry and value check, before a single draw."""
    depth = len(drafts)
    if len(q_rows) != depth:
        raise RowCountError(f"{depth} drafts need {depth} draft rows, got {len(q_rows)}")
    check_geometry(
        witness, depth + 1, f"{depth} drafts", vocab_size,
        [("frontier", frontier)] + [(f"draft {i}", d) for i, d in enumerate(drafts)],
    )  # fmt: skip
    for i, (token, row) in enumerate(zip(drafts, q_rows, strict=True)):
        row.validate(vocab_size, f"draft row {i}")
        if row.probability(int(token)) <= 0.0:
            raise DraftZeroProbabilityError(
                f"draft {i} token {int(token)} has draft probability q = 0 in its row"
            )
    check_probability_rows(witness, "witness")


def replay_drafts(
    state: Mt19937, drafts: Sequence[int], q_rows: Sequence[SparseRow], greedy: bool
) -> Mt19937:
    """Step 1 replayed: refuse drafts the draws from `state` would not have selected.

    Returns the state after drafting; `state` itself is not advanced.
    """
    rng = state.copy()
    for i, (token, row) in enumerate(zip(drafts, q_rows, strict=True)):
        if greedy:
            expected = int(row.ids[argmax_lowest(row.weights)])
        else:
            expected = int(row.ids[sample_ordered(row.weights, rng.uniform_f64())])
        if expected != int(token):
            raise DraftMismatchError(
                f"draft {i}: the replayed draw selects token {expected}, "
                f"the request declares {int(token)}"
            )
    return rng


def judge_round(
    state: Mt19937,
    frontier: int,
    drafts: Sequence[int],
    q_rows: Sequence[SparseRow],
    witness: np.ndarray,
    *,
    greedy: bool,
) -> RoundDecision:
    """Validate, replay the drafting draws, then accept/reject and pick the next frontier."""
    vocab = witness.shape[-1] if witness.ndim == 2 else 0
    validate_round(frontier, drafts, q_rows, witness, vocab)
    start = state.draws
    rng = replay_drafts(state, drafts, q_rows, greedy)
    depth = len(drafts)
    for i in range(depth):
        token = int(drafts[i])
        p_row = witness[i]
        if greedy:
            if token == argmax_lowest(p_row):
                continue
            return RoundDecision(i, argmax_lowest(p_row), rng, rng.draws - start)
        u = rng.uniform_f64()
        p = float(p_row[token])
        q = q_rows[i].probability(token)
        if p > 0.0 and u < p / q:  # a token with p = 0 is never accepted
            continue
        residual = np.maximum(p_row - q_rows[i].dense(vocab), 0.0)
        if not np.any(residual > 0.0):
            residual = p_row
        nxt = sample_ordered(residual, rng.uniform_f64())
        return RoundDecision(i, nxt, rng, rng.draws - start)
    bonus_row = witness[depth]
    nxt = argmax_lowest(bonus_row) if greedy else sample_ordered(bonus_row, rng.uniform_f64())
    return RoundDecision(depth, nxt, rng, rng.draws - start)


# --- the slow float64 reference ------------------------------------------------------------


def sample_ordered_reference(weights: list[float], u: float) -> int:
    total = 0.0
    cumulative = []
    for w in weights:
        total += w
        cumulative.append(total)
    threshold = u * total
    for index, c in enumerate(cumulative):
        if c > threshold:
            return index
    return max(i for i, w in enumerate(weights) if w > 0.0)


def argmax_reference(row: list[float]) -> int:
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


def judge_round_reference(
    state: Mt19937,
    frontier: int,
    drafts: Sequence[int],
    q_rows: Sequence[SparseRow],
    witness: np.ndarray,
    *,
    greedy: bool,
) -> RoundDecision:
    """The same algorithm as `judge_round`, as plain float64 loops over Python lists."""
    vocab = witness.shape[-1] if witness.ndim == 2 else 0
    validate_round(frontier, drafts, q_rows, witness, vocab)
    rng = state.copy()
    start = rng.draws
    q_dense: list[list[float]] = []
    for i, row in enumerate(q_rows):
        ids, weights = [int(t) for t in row.ids], [float(w) for w in row.weights]
        pick = (
            argmax_reference(weights)
            if greedy
            else sample_ordered_reference(weights, rng.uniform_f64())
        )
        if ids[pick] != int(drafts[i]):
            raise DraftMismatchError(
                f"draft {i}: the replayed draw selects token {ids[pick]}, "
                f"the request declares {int(drafts[i])}"
            )
        z = 0.0
        for w in weights:
            z += w
        dense = [0.0] * vocab
        for t, w in zip(ids, weights, strict=True):
            dense[t] = w / z
        q_dense.append(dense)
    rows = [[float(v) for v in r] for r in witness]
    for i, token in enumerate(int(d) for d in drafts):
        if greedy:
            if token == argmax_reference(rows[i]):
                continue
            return RoundDecision(i, argmax_reference(rows[i]), rng, rng.draws - start)
        u = rng.uniform_f64()
        p, q = rows[i][token], q_dense[i][token]
        if p > 0.0 and u < p / q:
            continue
        residual = [max(pv - qv, 0.0) for pv, qv in zip(rows[i], q_dense[i], strict=True)]
        if not any(r > 0.0 for r in residual):
            residual = rows[i]
        return RoundDecision(
            i, sample_ordered_reference(residual, rng.uniform_f64()), rng, rng.draws - start
        )
    last = rows[len(drafts)]
    nxt = argmax_reference(last) if greedy else sample_ordered_reference(last, rng.uniform_f64())
    return RoundDecision(len(drafts), nxt, rng, rng.draws - start)
