"""The target's log-probabilities of the tokens a round emits, as the API returns them.

Each emitted token carries its log-probability under the target's raw distribution (the
softmax of the raw logits row that judged it, before temperature, top-k or top-p: vLLM's
default `raw_logprobs`) and the k most probable tokens of that row with theirs, most probable
first, the lower id first on ties. Computed in float64 from the very rows the verifier judged
with, so a token a draft proposed and the target accepted carries the target's value, never
the draft's. Pure: rows in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the row's `k` most probable tokens."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """Rows of raw logits (n, V) -> float64 log-probabilities (-inf where the logit is)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the `k` largest entries of `row`, largest first, the lower id first on
    ties (a stable sort of -row)."""
    k = min(k, row.shape[-1])
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k < row.shape[-1]:  # narrow to the k-th value first (ties at it all kept), then sort
        kth = np.partition(row, -k)[-k]
        ids = np.flatnonzero(row >= kth)
    else:
        ids = np.arange(row.shape[-1])
    order = np.lexsort((ids, -row[ids]))
    return ids[order][:k]


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], k: int) -> tuple[TokenLogprobs, ...]:
    """`tokens[i]`'s log-probability under raw row `logits[i]`, with that row's top `k`."""
    rows = np.atleast_2d(np.asarray(logits))
    if rows.shape[0] != len(tokens):
        raise ValueError(f"{len(tokens)} tokens need as many rows, got {rows.shape[0]}")
    lp = log_softmax64(rows)
    out = []
    for row, token in zip(lp, tokens, strict=True):
        ids = top_k(row, k)
        out.append(
            TokenLogprobs(
                float(row[token]),
                tuple(int(i) for i in ids),
                tuple(float(row[i]) for i in ids),
            )
        )
    return tuple(out)
