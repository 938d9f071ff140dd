"""The target side of a round: witness rows for [frontier, drafts], then settle the KV
(a tree round's: its frontier and nodes, then `keep_tree_path`).

The executor keeps the target's KV equal to the transcript minus the frontier; a round
appends [f, d_0..d_D-1], and `settle` keeps f and the accepted drafts (a + 1 tokens).

`witness_batch` serves the rounds of several sessions at once: each executor first holds its
transcript minus the frontier (a session whose KV was evicted re-evaluates it here), then
every round's [f, drafts] goes through one forward when the backend batches sequences
(`muser.backend.MultiSequenceBackend`), one after another otherwise.

A capturing session's round (muser.capture) evaluates again, from the first position whose
rows the proposer has not been sent (`capture_from`), and keeps its capture layers' rows
from there (`TargetExecutor.captured`): in the batch's forward where the backend captures
per sequence (`evaluate_batch_capture`), else alone. A capturing tree round keeps the rows
of every block entry after those (`prepare_tree`, `keep_tree_captured`): the judge picks the
root's and the accepted path's.

Lookahead: before a round's request arrives, the proposer may name the tokens it drafted for
it (a `Lookahead` hint). `look_ahead` evaluates [f, drafts] after the transcript then, while
the request is still on its way (its PREPARED fsync, signature, admission); when the request
names the same tokens after the same transcript, `witness_batch` takes those rows instead of
a forward. They are the rows that forward would give: the same tokens on the same KV (a
batched forward may differ from a lone one in the last bits, as for any batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from muser.backend import ModelBackend, evaluate_batch, trees_on_held
from muser.cursor import KvCursor, owner


class Capture(NamedTuple):
    """What a capturing round keeps: its layers' rows from position `first` on."""

    first: int
    layers: tuple[int, ...]


class Witness(NamedTuple):
    """One round for `witness_batch` (a plain `(executor, transcript, drafts)` tuple is one
    too)."""

    executor: TargetExecutor
    transcript: Sequence[int]
    drafts: Sequence[int]
    tree: Any = None
    """A tree round's `muser.tree.Tree` (`drafts` are its nodes' tokens); None for a chain."""
    capture: Capture | None = None


class TargetExecutor:
    def __init__(self, backend: ModelBackend) -> None:
        self.cursor = KvCursor(backend)
        self._ahead: tuple[list[int], np.ndarray, dict, tuple, float] | None = None
        """The last `look_ahead`: its tokens, their rows, its captured rows and their layers,
        the seconds its forward took."""
        self.ahead_s = 0.0
        """The forward seconds of the rows the last round took from a lookahead (0: none)."""
        self.captured: dict[int, np.ndarray] = {}
        """A capturing round's rows per layer, from its `Capture.first` on, as its witness
        forward left them (empty for a round that captures nothing)."""

    def look_ahead(
        self, transcript: Sequence[int], drafts: Sequence[int], clock, layers: Sequence[int] = ()
    ) -> float | None:
        """Evaluate the round [transcript[-1], *drafts] now, before its request: append the
        round's tokens after transcript[:-1], keeping their rows (and `layers`' rows: a
        capturing session's round whose rows start at its frontier) for `take_ahead`.
        Returns the forward's seconds (`clock` the caller's); None, and nothing evaluated,
        when the KV does not hold transcript[:-1] (a hint never rebuilds a KV: on a shared
        one that would take it from the session that holds it)."""
        self._ahead = None
        kept = transcript[:-1]
        if self.cursor.reusable(kept) != len(kept):
            return None
        tokens = [int(transcript[-1]), *(int(d) for d in drafts)]
        layers = tuple(layers)
        t0 = clock()
        self.cursor.hold(kept)  # drops what it holds past `kept` (nothing to evaluate)
        if layers:
            rows, captured = self.cursor.backend.evaluate_capture(tokens, layers)
            self.cursor.record(tokens, rows)
        else:
            rows, captured = self.cursor.extend(tokens), {}
        seconds = clock() - t0
        self._ahead = (tokens, rows, captured, layers, seconds)
        return seconds

    def take_ahead(
        self, transcript: Sequence[int], drafts: Sequence[int], capture: Capture | None = None
    ) -> np.ndarray | None:
        """The rows `look_ahead` made for this very round (same tokens after the same
        transcript, the same capture from its frontier on, and the KV still standing where it
        left it), their forward's seconds in `ahead_s`, its captured rows in `captured`; None
        otherwise. Either way the lookahead is spent."""
        ahead, self._ahead, self.ahead_s, self.captured = self._ahead, None, 0.0, {}
        if ahead is None:
            return None
        tokens, rows, captured, layers, seconds = ahead
        if tokens != [int(transcript[-1]), *(int(d) for d in drafts)]:
            return None
        wanted = () if capture is None else capture.layers
        if layers != tuple(wanted) or (capture and capture.first != len(transcript) - 1):
            return None
        if not self.cursor.holds([*transcript[:-1], *tokens]):
            return None
        self.ahead_s, self.captured = seconds, captured
        return rows

    def drop_ahead(self) -> None:
        """Spend any lookahead unused (a tree round takes none: its forward has a tree's
        mask)."""
        self._ahead, self.ahead_s = None, 0.0

    def witness_logits(
        self, transcript: Sequence[int], drafts: Sequence[int], capture: Capture | None = None
    ) -> np.ndarray:
        """Raw logits (D+1, V) for [frontier, *drafts] after transcript[:-1] (and, with
        `capture`, its rows in `captured`)."""
        if (rows := self.take_ahead(transcript, drafts, capture)) is not None:
            return rows
        if capture is None:
            self.cursor.hold(transcript[:-1])
            return self.cursor.extend([transcript[-1], *drafts])
        _, tokens = self.prepare(transcript, drafts, redo_from=capture.first)
        rows, captured = self.cursor.backend.evaluate_capture(tokens, capture.layers)
        self.cursor.record(tokens, rows)
        return self.keep_captured(transcript, drafts, capture, tokens, rows, captured)

    def keep_captured(self, transcript, drafts, capture: Capture, tokens, rows, captured):
        """After a capturing round's forward of `tokens` (from `prepare`, ending with the
        round's own): keep each layer's rows from `capture.first` in `captured`; return the
        round's witness rows."""
        start = len(transcript) - len(tokens) + len(drafts)  # the position of tokens[0]
        skip, round_ = capture.first - start, len(tokens) - 1 - len(drafts)
        self.captured = {layer: c[skip:] for layer, c in captured.items()}
        return rows[round_:]

    def prepare(
        self, transcript: Sequence[int], drafts: Sequence[int], redo_from: int | None = None
    ) -> tuple[int, list[int]]:
        """Hold transcript[:-1]; return (tokens re-evaluated to get there, the round's tokens
        [frontier, *drafts] still to evaluate). `redo_from`: hold at most the first
        `redo_from` tokens instead, the rest of transcript[:-1] coming first in the tokens
        returned (a capturing round evaluates again what it must send rows of)."""
        kept = transcript[:-1]
        reused = self.cursor.reusable(kept)
        start = len(kept) if redo_from is None else min(reused, redo_from)
        self.cursor.hold(kept[:start])
        again = [int(t) for t in kept[start:]]
        return len(kept) - reused, [*again, int(transcript[-1]), *(int(d) for d in drafts)]

    def prepare_tree(self, transcript: Sequence[int], tree, capture: Capture | None) -> list[int]:
        """Hold transcript[:-1] for a tree round; return its block [frontier, *nodes]. A
        capturing round whose rows start before its frontier (`capture.first`: a session's
        first round since an open, or after an eviction) evaluates those positions first, in
        a forward of their own, their rows kept for `keep_tree_captured`."""
        self.captured = {}
        block = [int(transcript[-1]), *(int(t) for t in tree.tokens)]
        if capture is None or capture.first >= len(transcript) - 1:
            self.prepare(transcript, ())
            return block
        _, again = self.prepare(transcript, (), redo_from=capture.first)
        again = again[:-1]  # (the frontier is the block's root)
        rows, captured = self.cursor.backend.evaluate_capture(again, capture.layers)
        self.cursor.record(again, rows)
        skip = capture.first - (len(transcript) - 1 - len(again))
        self.captured = {layer: c[skip:] for layer, c in captured.items()}
        return block

    def keep_tree_captured(self, block_rows: dict[int, np.ndarray]) -> None:
        """After a capturing tree round's forward: `captured` holds, per layer, the rows from
        `capture.first` up to the frontier (`prepare_tree`), then every block entry's (root
        first); `tree_captured` picks the committed ones once the path is known."""
        self.captured = {
            layer: np.concatenate([self.captured[layer], rows]) if layer in self.captured
            else rows
            for layer, rows in block_rows.items()
        }  # fmt: skip

    def witness_tree(
        self, transcript: Sequence[int], tree, capture: Capture | None = None
    ) -> np.ndarray:
        """A tree round alone on a backend that evaluates trees on the sequence it holds
        (`trees_on_held`: vLLM): hold transcript[:-1], then the frontier and the nodes; the
        block is held until `keep_tree_path`. Raw logits (1 + nodes, V); a capturing round's
        rows in `captured`, as `prepare_tree` and `keep_tree_captured` leave them."""
        self.drop_ahead()
        block = self.prepare_tree(transcript, tree, capture)
        backend = self.cursor.backend
        if capture is None:
            return backend.evaluate_tree(backend, block, tree.parents)
        rows, captured = backend.evaluate_tree_capture(backend, block, tree.parents, capture.layers)
        self.keep_tree_captured(captured)
        return rows

    def keep_tree_path(self, frontier: int, tree, path: Sequence[int], logits: np.ndarray):
        """After a tree round: keep the frontier's and the accepted path's KV (the path's
        keys move next to the frontier's, `keep_path`), drop the other nodes'. On a held
        sequence that another session's round shaped since (`trees_on_held`, sessions taking
        turns in one batch), nothing is kept: this session's next round rebuilds its KV."""
        if owner(self.cursor.backend) is not self.cursor:
            return
        self.cursor.backend.keep_path(list(path))
        at = [0, *(i + 1 for i in path)]
        self.cursor.record([int(frontier), *(int(tree.tokens[i]) for i in path)], logits[at])

    def settle(self, transcript_len: int, accepted: int) -> None:
        """Keep the KV of the frontier and the accepted drafts; drop the rest."""
        self.cursor.truncate(transcript_len + accepted)


def witness_batch(backend: ModelBackend, rounds: Sequence[tuple]) -> list[np.ndarray]:
    """Raw logits per round (`Witness`), as `witness_logits` returns them, in one forward
    of `backend` when it batches. Every executor must hold its own sequence of `backend` (or
    all share `backend` itself, which then runs them in turn). A tree round's frontier and
    nodes go in the same forward (`evaluate_mixed`: each node sees its ancestors), their
    block held until `keep_tree_path`; capturing rounds go in it with their own layers
    (`evaluate_batch_capture`, or `evaluate_mixed_capture` beside a tree: a capturing tree
    round keeps every block entry's rows, `keep_tree_captured`)."""
    if not rounds:
        return []
    rounds = [Witness(*r) for r in rounds]
    trees = any(r.tree is not None for r in rounds)
    captures = any(r.capture is not None for r in rounds)
    if any(r.executor.cursor.backend is backend for r in rounds):
        if trees and not trees_on_held(backend):
            raise ValueError("a tree round needs a sequence of its own (a KV per session)")
        return [
            r.executor.witness_logits(r.transcript, r.drafts, r.capture)
            if r.tree is None
            else r.executor.witness_tree(r.transcript, r.tree, r.capture)
            for r in rounds
        ]
    ahead = [
        r.executor.take_ahead(r.transcript, r.drafts, r.capture)
        if r.tree is None
        else r.executor.drop_ahead()
        for r in rounds
    ]
    if any(a is not None for a in ahead):  # those rows are made; the rest go in one forward
        rest = [r for r, a in zip(rounds, ahead, strict=True) if a is None]
        made = iter(witness_batch(backend, rest))
        return [a if a is not None else next(made) for a in ahead]
    try:
        work = [
            (
                r.executor.cursor.backend,
                r.executor.prepare(r.transcript, r.drafts, r.capture and r.capture.first)[1]
                if r.tree is None
                else r.executor.prepare_tree(r.transcript, r.tree, r.capture),
                None if r.tree is None else r.tree.parents,
                () if r.capture is None else r.capture.layers,
            )
            for r in rounds
        ]
        captured: list[dict] = [{} for _ in rounds]
        if trees and captures:
            got = backend.evaluate_mixed_capture(work)  # type: ignore[attr-defined]
            rows, captured = [g[0] for g in got], [g[1] for g in got]
        elif trees:
            rows = backend.evaluate_mixed([w[:3] for w in work])  # type: ignore[attr-defined]
        elif captures:
            got = backend.evaluate_batch_capture(  # type: ignore[attr-defined]
                [(seq, tokens, layers) for seq, tokens, _, layers in work]
            )
            rows, captured = [g[0] for g in got], [g[1] for g in got]
        else:
            rows = evaluate_batch(backend, [(seq, tokens) for seq, tokens, *_ in work])
    except Exception:  # a backend may have appended some sequences before it refused
        for r in rounds:
            r.executor.cursor.realign()
        raise
    out = []
    for r, (_, tokens, parents, _), rows_r, kept in zip(rounds, work, rows, captured, strict=True):
        ex = r.executor
        if parents is None:  # (a tree's block is recorded by keep_tree_path)
            ex.cursor.record(tokens, rows_r)
        if r.capture is None:
            ex.captured = {}
            out.append(rows_r)
        elif parents is not None:
            ex.keep_tree_captured(kept)
            out.append(rows_r)
        else:
            out.append(ex.keep_captured(r.transcript, r.drafts, r.capture, tokens, rows_r, kept))
    return out


def witness_each(backend: ModelBackend, rounds: Sequence[tuple]) -> list[np.ndarray | Exception]:
    """`witness_batch`, but one round's failure does not fail the others: when the batch is
    refused, each round runs alone and a round that still fails gets its exception in its
    place."""
    try:
        return list(witness_batch(backend, rounds))
    except Exception:
        out: list[np.ndarray | Exception] = []
        for r in rounds:
            try:
                out.append(witness_batch(backend, [r])[0])
            except Exception as exc:
                out.append(exc)
        return out
