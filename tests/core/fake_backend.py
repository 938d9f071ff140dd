"""A tiny deterministic backend honouring the ModelBackend contract, for lane-logic tests.

Logits are a pure function of the last `order` tokens (hashed into a seeded generator), so
two instances with different `order` or `salt` disagree the way a draft and a target do.
"""

from __future__ import annotations

import hashlib

import numpy as np

from muser.backend import Geometry, ModelIdentity
from muser.errors import RollbackError


class FakeBackend:
    def __init__(self, vocab: int = 24, order: int = 3, salt: int = 0, sharpness: float = 3.0):
        self.identity = ModelIdentity(f"fake-{order}-{salt}", "fake-tok", vocab, "fake", "")
        self.geometry = Geometry(4096, 1, 8, None, None)
        self.order, self.salt, self.sharpness = order, salt, sharpness
        self._vocab = vocab
        self._tokens: list[int] = []
        self.evaluated = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def length(self) -> int:
        return len(self._tokens)

    def _row(self, context: list[int]) -> np.ndarray:
        key = hashlib.sha256(repr((self.salt, context[-self.order :])).encode()).digest()
        gen = np.random.default_rng(int.from_bytes(key[:8], "little"))
        base = np.random.default_rng(self.salt + 1000).normal(size=self._vocab)
        return (base + gen.normal(size=self._vocab)) * self.sharpness

    def evaluate(self, tokens):
        rows = []
        for t in tokens:
            self._tokens.append(int(t))
            rows.append(self._row(self._tokens))
        self.evaluated += len(tokens)
        return np.array(rows, dtype=np.float64)

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self._tokens):
            raise RollbackError(f"cannot roll back {n} of {len(self._tokens)} tokens")
        del self._tokens[len(self._tokens) - n :]

    def reset(self) -> None:
        self._tokens.clear()
