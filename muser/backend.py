"""The model-backend contract both sides agree on.

A backend holds one causal LM and the KV cache of one sequence. `evaluate(tokens)` appends
`tokens` to the cached sequence and returns one float64 row of raw logits per appended token:
row i is the model's next-token logits after `tokens[i]`. `rollback(n)` drops the last `n`
tokens from the cache. Rows are raw logits; every transform (temperature, top-k, top-p,
normalisation) happens on the host in float64 (`muser.sampling`).

Target backends (`verifier_gx.backends`) and draft backends (`proposer_mac.backends`)
implement the same contract, so one contract test suite runs against all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ModelIdentity:
    """Who a model is, bit for bit.

    `model_digest` is SHA-256 over config, weights and tokenizer files; `tokenizer_digest`
    over the tokenizer files alone (draft and target must share it).
    """

    model_digest: str
    tokenizer_digest: str
    vocab_size: int
    architecture: str
    path: str


@dataclass(frozen=True)
class Geometry:
    """Geometry read from the checkpoint's own config (DESIGN.md §8), after overrides."""

    context_length: int
    num_layers: int
    hidden_size: int
    rope_theta: float | None
    sliding_window: int | None


@runtime_checkable
class ModelBackend(Protocol):
    identity: ModelIdentity
    geometry: Geometry

    @property
    def vocab_size(self) -> int: ...

    @property
    def length(self) -> int:
        """Number of tokens whose KV is in the cache."""
        ...

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; return float64 logits of shape (len(tokens), vocab_size)."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens of KV; refuses n < 0 or n > length (RollbackError)."""
        ...

    def reset(self) -> None:
        """Drop the whole cache."""
        ...
