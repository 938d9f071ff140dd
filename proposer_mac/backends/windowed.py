"""`--draft-window N`: a draft that conditions each row on its last N tokens only.

A wrapper over any `ModelBackend` with the same contract. Row i is the inner model's
next-token logits given just the `window` tokens ending at token i, as if the sequence had
started there (positions restart at 0). It is computed the simplest correct way: reset the
inner backend and evaluate that window, keeping the last row. `length`, `rollback` and
`reset` act on the full token list, so the driver cannot tell it from an unwindowed draft.
Each row costs one evaluation of up to `window` tokens; this is a knob for experiments
(how much context the draft needs), not a fast path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muser.backend import Geometry, ModelBackend, ModelIdentity
from muser.errors import InvalidOverrideError
from muser.geometry import check_rollback, check_room, check_tokens


class WindowedBackend:
    """`inner`, restricted to attend to the last `window` tokens for every row."""

    def __init__(self, inner: ModelBackend, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidOverrideError(f"draft window {window!r} is invalid: expected int ≥ 1")
        self.inner = inner
        self.window = window
        self._tokens: list[int] = []

    @property
    def identity(self) -> ModelIdentity:
        return self.inner.identity

    @property
    def geometry(self) -> Geometry:
        return self.inner.geometry

    @property
    def device(self) -> str | None:
        return getattr(self.inner, "device", None)

    @property
    def device_label(self) -> str:
        return getattr(self.inner, "device_label", "unknown")

    @property
    def forward_kind(self) -> str | None:
        return getattr(self.inner, "forward_kind", None)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def length(self) -> int:
        return len(self._tokens)

    def fork(self) -> WindowedBackend:
        """An empty sequence over the same weights and window (see TorchBackend.fork)."""
        inner = self.inner.fork() if hasattr(self.inner, "fork") else self.inner
        return WindowedBackend(inner, self.window)

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; row i from the `window` tokens ending at tokens[i]."""
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        sequence = list(self._tokens)  # committed only once every row is computed
        rows = np.zeros((len(ids), self.vocab_size))
        for i, token in enumerate(ids):
            sequence.append(token)
            self.inner.reset()
            rows[i] = self.inner.evaluate(sequence[-self.window :])[-1]
        self._tokens = sequence
        return rows

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens of the sequence (refuses n < 0 or n > length)."""
        check_rollback(n, self.length)
        self._tokens = self._tokens[: self.length - n]

    def reset(self) -> None:
        """Forget the sequence."""
        self._tokens.clear()
        self.inner.reset()
