"""Capture rows of every committed position (docs/conditioned.md), for a feature-conditioned draft.

`CaptureTap` is a target backend whose every evaluation also keeps the output rows of the
capture layers, indexed by position. Whatever the executor evaluates through it — a prompt's
prefill, a round's [frontier, drafts], a re-evaluation after an eviction — leaves its rows
there; after a round settles, the positions below the KV's length are exactly the committed
ones, so `rows(first, end)` hands the draft what the round committed. The next frontier is
never among them: its rows exist only after the next round evaluates it (the carried
frontier's off-by-one, tested in tests/proposer/test_conditioned.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from muser.backend import Geometry, ModelBackend, ModelIdentity, tree_evaluator
from muser.errors import RefusedError


class CaptureTap:
    """`backend` (which must offer `evaluate_capture`), keeping `layers`' rows by position."""

    def __init__(self, backend: ModelBackend, layers: Sequence[int]) -> None:
        if not hasattr(backend, "evaluate_capture"):
            raise RefusedError(
                f"the target backend {type(backend).__name__} cannot capture hidden rows, and "
                "a conditioned draft reads them: serve the target on the torch backend"
            )
        self.backend = backend
        self.layers = tuple(int(i) for i in layers)
        width = backend.geometry.hidden_size
        self._rows = {i: np.zeros((0, width), np.float32) for i in self.layers}
        self._block: dict[int, np.ndarray] = {}
        """A tree's rows per layer, every entry's, until `keep_path`."""

    @property
    def identity(self) -> ModelIdentity:
        return self.backend.identity

    @property
    def geometry(self) -> Geometry:
        return self.backend.geometry

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def length(self) -> int:
        return self.backend.length

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        first = self.backend.length
        logits, captured = self.backend.evaluate_capture(tokens, self.layers)
        self._store(first, captured)
        return logits

    def _store(self, first: int, captured: dict[int, np.ndarray]) -> None:
        for layer, rows in captured.items():
            end, kept = first + len(rows), self._rows[layer]
            if len(kept) < end:
                grown = np.zeros((max(end, 2 * len(kept)), kept.shape[1]), np.float32)
                grown[: len(kept)] = kept
                self._rows[layer] = kept = grown
            kept[first:end] = rows

    @property
    def trees_on_held(self) -> bool:
        """Over a torch target's sequence (`TorchSequence`) or a vLLM target the tap
        evaluates token trees on it (`evaluate_tree(tap, ...)`, `keep_path`), keeping the
        root's and the kept path's rows: the local tree lane with a conditioned draft."""
        return hasattr(tree_evaluator(self.backend), "evaluate_tree_capture")

    def evaluate_tree(
        self, seq: CaptureTap, tokens: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        """`evaluate_tree` on the tapped sequence, every entry's rows held until `keep_path`
        keeps the root's and the path's."""
        if seq is not self or not self.trees_on_held:
            raise TypeError("a capture tap evaluates trees on the target sequence it taps")
        logits, self._block = tree_evaluator(self.backend).evaluate_tree_capture(
            self.backend, tokens, parents, self.layers
        )
        return logits

    def keep_path(self, path: Sequence[int]) -> None:
        first = self.backend.length
        self.backend.keep_path(path)
        at = [0, *(i + 1 for i in path)]
        self._store(first, {layer: rows[at] for layer, rows in self._block.items()})
        self._block = {}

    def rollback(self, n: int) -> None:
        self.backend.rollback(n)

    def reset(self) -> None:
        self.backend.reset()

    def rows(self, first: int, end: int) -> dict[int, np.ndarray]:
        """The rows of positions [first, end), which the KV must hold."""
        if not 0 <= first <= end <= self.length:
            raise ValueError(f"rows [{first}, {end}) asked; the KV holds {self.length} positions")
        return {layer: rows[first:end].copy() for layer, rows in self._rows.items()}
