"""Sampling maths shared bit for bit by both sides (docs/design.md §2). Pure: no I/O, no RNG.

Target side: raw logits -> float64 probability rows under the session's params
(temperature, then top-k, then softmax, then top-p). Draft side: the same transform on the
draft's logits, then truncation to the `q_top_k` most probable tokens, giving a sparse row
(ascending token ids + float64 weights). Both sides normalise sparse weights the same way:
Z is the last element of the ascending-id cumulative sum.

`sample_ordered(w, u)` walks tokens in ascending id accumulating float64 weights and returns
the first index whose cumulative weight exceeds `u * Z`. Temperature 0 is greedy: rows are
one-hot at the argmax, lowest id winning ties, and no draw is consumed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from muser.errors import InvalidSamplingParamsError, InvalidWeightsError, TokenOutOfVocabularyError
from muser.round import DEFAULT_Q_TOP_K as DEFAULT_Q_TOP_K

LOGPROBS_MAX = 20
"""The most alternatives a session may ask logprobs for per token (vLLM's default bound)."""


@dataclass(frozen=True)
class SamplingParams:
    """Fixed per session at open and bound into the genesis head."""

    temperature: float = 0.0
    """0 = greedy (argmax, no draws); > 0 divides logits before the softmax."""
    top_k: int = 0
    """Keep only the k most probable tokens (ties at the k-th logit kept); 0 = off."""
    top_p: float = 1.0
    """Keep the smallest most-probable prefix whose mass reaches top_p; in (0, 1]."""
    max_tokens: int = 64
    """Tokens to emit after the prompt (the carried frontier counts once it is emitted)."""
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    """Generation ends after emitting any of these."""
    seed: int = 0
    """Seeds the session's MT19937 stream (init_genrand)."""
    logprobs: int | None = None
    """With k (0..LOGPROBS_MAX), every emitted token comes with the target's log-probability
    of it and the k most probable alternatives (muser.logprobs), signed in each result; None:
    none."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidSamplingParamsError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed < 0 or self.seed >= 2**32:
            raise InvalidSamplingParamsError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= LOGPROBS_MAX:
            raise InvalidSamplingParamsError(
                f"logprobs must be in [0, {LOGPROBS_MAX}] alternatives (or none), got "
                f"{self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_SCALAR_ROW = 16
"""`SparseRow.validate` checks rows up to this long value by value."""


@dataclass(frozen=True)
class SparseRow:
    """A draft row q: ascending token ids and their float64 weights (unnormalised)."""

    ids: np.ndarray
    weights: np.ndarray

    def validate(self, vocab_size: int, where: str) -> None:
        """Refuse out-of-vocabulary ids, unsorted/duplicate ids, bad weights."""
        ids, w = self.ids, self.weights
        if 0 < ids.size <= _SCALAR_ROW and ids.ndim == w.ndim == 1 and ids.shape == w.shape:
            # a short row (every greedy row has one entry): checked in Python, a dozen numpy
            # calls on so few values cost more; anything wrong is named by the checks below
            i, x = ids.tolist(), w.tolist()
            if (
                i[0] >= 0
                and i[-1] < vocab_size
                and all(a < b for a, b in zip(i[:-1], i[1:], strict=True))
                and all(math.isfinite(v) and v >= 0 for v in x)
                and any(v > 0 for v in x)
                and math.isfinite(sum(x))
            ):
                return
        if ids.ndim != 1 or w.ndim != 1 or ids.shape != w.shape or ids.size == 0:
            raise InvalidWeightsError(
                f"{where}: sparse row needs equal-length non-empty ids and weights, "
                f"got ids {ids.shape} and weights {w.shape}"
            )
        if ids.min() < 0 or ids.max() >= vocab_size:
            bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
            raise TokenOutOfVocabularyError(
                f"{where}: token id {bad} outside the vocabulary [0, {vocab_size})"
            )
        if ids.size > 1 and not np.all(np.diff(ids) > 0):
            raise InvalidWeightsError(f"{where}: sparse ids must be strictly ascending")
        _check_weights(w, where)

    def probability(self, token: int) -> float:
        """q(token) = w_token / Z, 0.0 when the token is absent."""
        pos = int(np.searchsorted(self.ids, token))
        if pos >= self.ids.size or self.ids[pos] != token:
            return 0.0
        return float(self.weights[pos]) / self.total

    @functools.cached_property
    def total(self) -> float:
        """Z, the last ascending cumulative weight (the sum `sample_ordered` scales by; a
        row is read several times a round, its weights never change)."""
        return float(np.cumsum(self.weights)[-1])

    def dense(self, vocab_size: int) -> np.ndarray:
        """The normalised dense row (float64)."""
        out = np.zeros(vocab_size, dtype=np.float64)
        out[self.ids] = self.weights / self.total
        return out


def _check_weights(w: np.ndarray, where: str) -> None:
    if not np.all(np.isfinite(w)):
        raise InvalidWeightsError(f"{where}: weights must be finite, got NaN or infinity")
    if np.any(w < 0):
        raise InvalidWeightsError(f"{where}: weights must be >= 0, got {float(w.min())!r}")
    if not np.any(w > 0):
        raise InvalidWeightsError(f"{where}: weights are all zero")
    with np.errstate(over="ignore"):  # each finite, their sum not: q = w / Z would be 0
        total = w.sum()
    if not np.isfinite(total):
        raise InvalidWeightsError(f"{where}: weights sum to infinity; expected a finite sum")


def check_probability_rows(rows: np.ndarray, where: str) -> None:
    """Refuse rows with NaN/inf, negative or all-zero weights (one vector pass when valid)."""
    if np.isfinite(rows).all() and not (rows < 0).any() and (rows > 0).any(axis=-1).all():
        return
    for i, row in enumerate(rows):
        _check_weights(row, f"{where} row {i}")


def sample_ordered(weights: np.ndarray, u: float) -> int:
    """First index whose ascending cumulative weight exceeds u * Z (Z = the last cumsum).

    If rounding leaves no cumulative value above u * Z (u within an ulp of 1), the last
    index with positive weight is taken, so a zero-weight token is never returned.
    """
    cum = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cum, u * cum[-1], side="right"))
    if index >= cum.size:
        index = int(np.flatnonzero(weights > 0)[-1])
    return index


def argmax_lowest(row: np.ndarray) -> int:
    """Greedy choice: the argmax, lowest id winning ties (numpy's argmax already does)."""
    return int(np.argmax(row))


def _softmax64(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Raw logits (n, V) or (V,) -> float64 probability rows under `params`."""
    x = np.asarray(logits, dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    if params.greedy:
        out = np.zeros_like(x)
        out[np.arange(x.shape[0]), np.argmax(x, axis=-1)] = 1.0
        return out[0] if squeeze else out
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    p = _softmax64(x)
    if params.top_p < 1.0:
        p = _top_p(p, params.top_p)
    return p[0] if squeeze else p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest prefix (descending probability, ascending id on ties) reaching top_p."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p  # the first token always has 0 before it
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    kept = np.where(keep, p, 0.0)
    return kept / np.sum(kept, axis=-1, keepdims=True)


def draft_row(logits: np.ndarray, params: SamplingParams, q_top_k: int) -> SparseRow:
    """The draft's sparse row: target-style transform, then the q_top_k most probable tokens."""
    if q_top_k < 1:
        raise InvalidSamplingParamsError(f"q_top_k must be >= 1, got {q_top_k}")
    if params.greedy:  # target_probs' one-hot row, without building it: its argmax
        token = int(np.argmax(np.asarray(logits, dtype=np.float64)))
        return SparseRow(np.array([token], dtype=np.int64), np.array([1.0]))
    p = target_probs(logits, params)
    k = min(q_top_k, int(np.count_nonzero(p)))
    ids = top_k_ids(p, k)
    return SparseRow(ids, p[ids].astype(np.float64))


def top_k_ids(p: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest entries, ties at the boundary going to the lowest ids
    (the same set a stable descending sort would give), in O(V) rather than O(V log V)."""
    if k >= p.size:
        return np.arange(p.size, dtype=np.int64)
    kth = np.partition(p, p.size - k)[p.size - k]
    above = np.flatnonzero(p > kth)
    ties = np.flatnonzero(p == kth)[: k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int64)


def check_stop_tokens(params: SamplingParams, vocab: int) -> None:
    """Refuse a stop token outside the target's vocabulary (the verifier at open, and the
    proposer before it journals a session, so both refuse with the same words)."""
    for token in params.stop_tokens:
        if not 0 <= token < vocab:
            raise TokenOutOfVocabularyError(
                f"stop token {token} outside the vocabulary [0, {vocab})"
            )
