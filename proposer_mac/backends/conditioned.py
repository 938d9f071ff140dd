"""The feature-conditioned draft as a `ModelBackend` (docs/conditioned.md; docs/conditioned.md).

The draft reads, for the token at position p, the target's capture rows after position p-1
(`install_features` hands them over as the target computes them) or, where the target has
not computed them yet, its own output row at p-1. That is the carried frontier's geometry:
after a round the target has evaluated every committed position but the next frontier, so
the frontier itself is read with a real feature and every drafted token after it with the
draft's own.

A position computed with its own feature is *stale* once the target's rows for p-1 arrive
(an accepted draft): the next `evaluate` first recomputes the KV from the first stale
position, then appends. Callers see the plain contract: `evaluate(tokens)` appends and
returns one row per token, `rollback`/`reset` drop KV (reset drops the installed features
too: they belong to the sequence).

Greedy branches (`Drafter.branch_steps`, docs/conditioned.md): `clone` copies the sequence
(its KV is shared until either side appends: every forward makes new tensors) and shares its
installed rows — a row is a fact of the session's transcript, whichever guessed outcome a
clone drafts on — so rows handed over while a branch runs reach the branch that is kept.
`owner` evaluates the clones' lockstep steps (one new token each) in one forward, each
reading its own KV through a padded batch (`_step_each`); anything else goes one by one.

Rows are float64 logits over the target's vocabulary, -inf outside the draft's reduced head.
Attention sees the last `window` positions (the checkpoint's, or the override's).

`runtime` picks the network's implementation: `torch` (`conditioned_torch`, also the trainer's)
or `mlx` (`conditioned_mlx`, Metal on a Mac); both compute the same rows from the same weights.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity
from muser.errors import InvalidOverrideError, ModelLoadError, RefusedError
from muser.geometry import check_rollback, check_room, check_tokens
from muser.identity import model_identity
from muser.tree import tree_depths
from proposer_mac.backends.conditioned_meta import (
    ConditionedSpec,
    check_target,
    read_spec,
    with_overrides,
)

Runtime = Literal["torch", "mlx"]
RUNTIMES: tuple[Runtime, ...] = ("torch", "mlx")


def load_engine(path: Path, spec: ConditionedSpec, runtime: str, device: str = "auto"):
    """The network on `runtime` with the checkpoint's weights (every tensor present, none
    extra: the torch module checks the names and shapes for both)."""
    import torch
    from safetensors.torch import load_file

    from proposer_mac.backends.conditioned_torch import ConditionedNet, TorchEngine

    if runtime not in RUNTIMES:
        raise InvalidOverrideError(f"runtime {runtime!r} is not one of {RUNTIMES}")
    net = ConditionedNet(spec)
    try:
        state = load_file(str(path / "model.safetensors"))
        net.load_state_dict(state, strict=True)
    except (OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{path}: the conditioned draft's weights do not load ({exc})"
        ) from exc
    if runtime == "torch":
        return TorchEngine(net.to(torch.float32)), "cpu"
    from proposer_mac.backends.conditioned_mlx import ConditionedMlx
    from proposer_mac.backends.mlx_draft import choose_device

    chosen = choose_device(device)  # type: ignore[arg-type]
    arrays = {name: value.numpy() for name, value in net.state_dict().items()}
    return ConditionedMlx(spec, arrays, chosen), chosen


@dataclass
class _Rows:
    """The target's capture rows installed for positions 0..known-1 (fused in layer order,
    rounded to the feature dtype), shared by a sequence and its clones."""

    rows: np.ndarray
    known: int = 0


@dataclass
class _Block:
    """A token tree evaluated after the held positions (`ConditionedDraft.evaluate_tree`):
    entry 0 the root, entry i + 1 node i; its keys follow the held ones in evaluation order
    (`order`, entry j's at `slot[j]`), and so do `outs` and `logits`, one per slot."""

    tokens: list[int]
    parents: list[int]
    order: list[int]
    outs: list[np.ndarray]
    logits: list[np.ndarray]
    slot: dict[int, int] = field(default_factory=dict)


class ConditionedDraft(HeldTokens):
    """A conditioned draft over one sequence (`ModelBackend`, plus `install_features`)."""

    label = "conditioned"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capture_layers: Sequence[int] | None = None,
        window: int | None = None,
        feature_dtype: str | None = None,
        runtime: str = "torch",
        device: str = "auto",
    ) -> None:
        root = Path(path).expanduser()
        self.spec = with_overrides(
            read_spec(root),
            capture_layers=tuple(capture_layers) if capture_layers is not None else None,
            window=window,
            feature_dtype=feature_dtype,
        )
        self.identity: ModelIdentity = model_identity(root)
        spec = self.spec
        self.geometry = Geometry(spec.context_length, 1, spec.hidden_size, spec.rope_theta,
                                 spec.window)  # fmt: skip
        self._engine, self.device = load_engine(root, spec, runtime, device)
        self.runtime = runtime
        self._head_ids = self._engine.head_ids
        self._round = np.float16 if spec.feature_dtype == "float16" else np.float32
        self._width = spec.target_hidden_size * len(spec.capture_layers)
        self.reset()

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.spec.capture_layers

    def check_target(self, target: ModelIdentity, where: str = "session open") -> None:
        check_target(self.spec, target, where)

    # ---- features -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the target's rows have been handed over at all: until then (a session's
        first round, or its first after a restart) the drafter declines, and the target's
        round reads the prompt (`proposer_mac.drafting`)."""
        return self._rows.known > 0

    def fork(self) -> ConditionedDraft:
        """An empty sequence over the same network (one per session on the proposer)."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    def clone(self) -> ConditionedDraft:
        """This sequence again, to grow and roll back on its own (a greedy branch: module
        note). Shares the KV tensors (never written in place) and the installed rows; a
        tree block not kept is not cloned."""
        twin = copy.copy(self)
        twin._tokens = list(self._tokens)
        twin._block = None
        if self._block is not None:
            keep = self.length
            twin._past = None if keep == 0 else (self._past[0][:, :, :keep],
                                                 self._past[1][:, :, :keep])  # fmt: skip
        return twin

    @property
    def owner(self) -> _Clones:
        """This draft's sequences as one `MultiSequenceBackend` (`Drafter.branch_steps`)."""
        return _Clones(self)

    @property
    def features_known(self) -> int:
        """Positions 0..n-1 whose target rows are installed (contiguous from 0)."""
        return self._rows.known

    def install_features(self, first: int, rows: Mapping[int, np.ndarray]) -> None:
        """The target's rows at `first`, `first + 1`, ...: one (n, target width) array per
        capture layer. Installed rows must continue (or overlap) what is known: a gap would
        leave positions neither real nor the draft's own."""
        missing = [layer for layer in self.spec.capture_layers if layer not in rows]
        if missing:
            raise RefusedError(
                f"features for layers {sorted(rows)} received; the draft reads "
                f"{list(self.spec.capture_layers)} (missing {missing})"
            )
        parts = [np.asarray(rows[layer], dtype=np.float32) for layer in self.spec.capture_layers]
        n = len(parts[0])
        shape = (n, self.spec.target_hidden_size)
        if any(p.shape != shape for p in parts):
            got = [p.shape for p in parts]
            raise RefusedError(f"feature rows of shapes {got} received; expected {shape} each")
        have = self._rows
        if first < 0 or first > have.known:
            raise RefusedError(
                f"features from position {first} received; {have.known} are known, so the "
                f"next must start at or before {have.known}"
            )
        if n == 0:
            return
        end = first + n
        if end > len(have.rows):
            grown = np.zeros((max(end, 2 * len(have.rows)), self._width), np.float32)
            grown[: have.known] = have.rows[: have.known]
            have.rows = grown
        row = np.concatenate(parts, axis=1).astype(self._round).astype(np.float32)
        have.rows[first:end] = row
        have.known = max(have.known, end)

    # ---- the contract -------------------------------------------------------------------

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        self._drop_block()
        self._refresh()
        return self._append(ids)

    def _refresh(self) -> None:
        """Recompute the held positions from the first stale one, once the target's rows
        before it arrived (module note)."""
        stale = self._first_self
        if stale is not None and stale - 1 < self._rows.known:
            held = self._tokens[stale:]
            self._drop(len(held))
            self._append(held)

    def rollback(self, n: int) -> None:
        check_rollback(n, self.length)
        self._drop_block()
        self._drop(n)

    # ---- token trees (muser.tree), drafted on this sequence itself ----------------------

    trees_on_held = True
    """Token trees are evaluated on this very sequence (`evaluate_tree(self, ...)`)."""

    def evaluate_tree(
        self, seq: ConditionedDraft, tokens: Sequence[int], parents: Sequence[int]
    ) -> np.ndarray:
        """A token tree after the held tokens (`TorchBackend.evaluate_tree`'s contract):
        `tokens[0]` the root at position `length`, node i (`tokens[i + 1]`, parent
        `parents[i]`) at length + its depth, seeing the held positions in the window and its
        own ancestors. The root reads the target's row before it where installed (else the
        draft's own, as `evaluate`); a node reads its parent's output row: its rows are those
        `evaluate` gives along its path with nothing installed past the root. A node reads
        its parent's output, so each depth is one forward; a tree that extends the block
        held (the tree drafted a depth at a time, `muser.tree.draft_tree`) evaluates only its
        new nodes. Float64 logits (len(tokens), vocab); the block is held until `keep_path`."""
        if seq is not self:
            raise TypeError(f"{seq!r} is not this draft (its trees go on its own sequence)")
        ids = check_tokens(tokens, self.vocab_size)
        depths = tree_depths(parents, len(ids))
        check_room(self.length, max(depths) + 1, self.geometry.context_length)
        block = self._block
        k = 0 if block is None else len(block.tokens)
        if block is not None and (
            ids[:k] != block.tokens or list(parents[: k - 1]) != block.parents or k > len(ids)
        ):
            self._drop_block()
            block, k = None, 0
        if block is None:
            self._refresh()
            block = self._block = _Block([], [], [], [], [])
        block.tokens, block.parents = ids, [int(p) for p in parents]
        new = range(k, len(ids))
        try:
            for depth in sorted({depths[j] for j in new}):
                self._tree_forward(block, [j for j in new if depths[j] == depth], depths)
        except BaseException:  # a block part-evaluated is no block: the held positions stand
            self._drop_block()
            raise
        out = np.full((len(ids), self.vocab_size), -np.inf)
        out[:, self._head_ids] = np.stack([block.logits[block.slot[j]] for j in range(len(ids))])
        return out

    def _tree_forward(self, block: _Block, level: list[int], depths: list[int]) -> None:
        """One forward of the block entries `level` (one depth), after the held positions
        and the entries evaluated before."""
        engine, n, start = self._engine, len(level), self.length
        slot = {**block.slot, **{j: len(block.order) + r for r, j in enumerate(level)}}
        feature = np.zeros((1, n, self.spec.hidden_size), np.float32)
        for r, j in enumerate(level):
            if j > 0:  # its parent's output row
                feature[0, r] = block.outs[slot[block.parents[j - 1] + 1]]
            elif 0 <= start - 1 < self._rows.known:  # the root: the target's row before it
                feature[0, r] = engine.fuse_features(self._rows.rows[start - 1 : start])[0]
            elif start > 0:
                feature[0, r] = self._outs[start - 1]
        order = [*block.order, *level]
        positions = start + np.array([depths[j] for j in level], dtype=np.int64)
        key_positions = np.concatenate(
            [np.arange(start), start + np.array([depths[j] for j in order], np.int64)]
        )
        seen = np.zeros((n, len(key_positions)), dtype=bool)
        seen[:, :start] = True
        for r, j in enumerate(level):
            entry = j
            while True:  # itself and its ancestors
                seen[r, start + slot[entry]] = True
                if entry == 0:
                    break
                entry = block.parents[entry - 1] + 1
        seen &= key_positions[None, :] > positions[:, None] - self.spec.window
        ids = np.array([[block.tokens[j] for j in level]], dtype=np.int64)
        outs, logits, self._past = engine.forward(ids, feature, positions, seen, self._past)
        block.slot, block.order = slot, order  # (only once the forward ran)
        block.outs.extend(outs[0])
        block.logits.extend(logits[0].astype(np.float64))

    def keep_path(self, path: Sequence[int]) -> None:
        """After `evaluate_tree`: hold its root and the nodes of `path` (node indices, root's
        child first), drop the rest of the block. The kept nodes read the draft's own rows,
        so they are stale once the target's rows before them arrive (module note)."""
        block = self._block
        if block is None:
            raise ValueError("keep_path: no tree block is held (evaluate_tree first)")
        if any(not 0 <= i < len(block.tokens) - 1 for i in path):
            raise ValueError(
                f"keep_path: nodes {list(path)} outside the block's {len(block.tokens) - 1}"
            )
        start = self.length
        slots = [block.slot[0], *(block.slot[i + 1] for i in path)]
        self._past = self._engine.take(self._past, [*range(start), *(start + s for s in slots)])
        self._outs = np.concatenate([self._outs, np.stack([block.outs[s] for s in slots])])
        if self._first_self is None and start > 0 and start - 1 >= self._rows.known:
            self._first_self = start
        elif self._first_self is None and path:
            self._first_self = start + 1
        self._tokens.extend([block.tokens[0], *(block.tokens[i + 1] for i in path)])
        self._block = None

    def _drop_block(self) -> None:
        """Forget a tree block held past the held positions (its keys included)."""
        if self._block is None:
            return
        self._block = None
        keep = self.length
        self._past = None if keep == 0 else (self._past[0][:, :, :keep], self._past[1][:, :, :keep])

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._past = None
        self._outs = np.zeros((0, self.spec.hidden_size), np.float32)
        self._first_self: int | None = None
        """The first held position computed with the draft's own feature (None: none)."""
        self._rows = _Rows(np.zeros((0, self._width), np.float32))
        self._block: _Block | None = None
        """A token tree evaluated past the held positions, not kept yet (`keep_path`)."""

    def _drop(self, n: int) -> None:
        if n == 0:
            return
        keep = self.length - n
        del self._tokens[keep:]
        self._past = (self._past[0][:, :, :keep], self._past[1][:, :, :keep])
        self._outs = self._outs[:keep]
        if self._first_self is not None and self._first_self >= keep:
            self._first_self = None

    def _append(self, ids: list[int]) -> np.ndarray:
        """Evaluate `ids` after the held tokens: runs of positions whose features are known
        go in one forward; a position reading the draft's own feature waits for its
        predecessor's output."""
        out = np.full((len(ids), self.vocab_size), -np.inf)
        done = 0
        while done < len(ids):
            start = self.length
            stop = start + 1
            while stop < start + len(ids) - done and stop - 1 < self._rows.known:
                stop += 1
            out[done : done + stop - start, self._head_ids] = self._forward(
                ids[done : done + stop - start], start
            )
            done += stop - start
        return out

    def _forward(self, ids: list[int], start: int) -> np.ndarray:
        n, engine = len(ids), self._engine
        feature = np.zeros((1, n, self.spec.hidden_size), np.float32)
        known = self._rows.known
        real = [p for p in range(start, start + n) if 0 <= p - 1 < known]
        if real:
            rows = self._rows.rows[real[0] - 1 : real[-1]]
            feature[0, real[0] - start :] = engine.fuse_features(rows)
        if start > 0 and start - 1 >= known:  # the draft's own row at start - 1
            feature[0, 0] = self._outs[start - 1]
            if self._first_self is None:
                self._first_self = start
        positions = np.arange(start, start + n)
        keys = np.arange(start + n)
        seen = (keys[None, :] <= positions[:, None]) & (
            keys[None, :] > positions[:, None] - self.spec.window
        )
        outs, logits, self._past = engine.forward(
            np.array([ids], dtype=np.int64), feature, positions, seen, self._past
        )
        self._outs = np.concatenate([self._outs, outs[0]])
        self._tokens.extend(ids)
        return logits[0].astype(np.float64)

    def _steps_alone(self, tokens: Sequence[int]) -> bool:
        """Whether `evaluate(tokens)` would be one forward of one position with nothing
        before it (no block to drop, nothing stale to recompute, room left): what
        `_step_each` batches."""
        stale = self._first_self
        return (
            len(tokens) == 1
            and self._block is None
            and 0 < self.length < self.geometry.context_length
            and (stale is None or stale - 1 >= self._rows.known)
        )

    def _step_feature(self, start: int) -> np.ndarray:
        """The feature of a token at `start` (> 0) evaluated alone: the target's row at
        start - 1 where installed, else the draft's own (as `_forward` reads them)."""
        if start - 1 < self._rows.known:
            return self._engine.fuse_features(self._rows.rows[start - 1 : start])[0]
        if self._first_self is None:
            self._first_self = start
        return self._outs[start - 1]


class _Clones:
    """A conditioned draft's sequences as a `MultiSequenceBackend`, for greedy branches
    (`muser.backend.batches`, `proposer_mac.drafting.run_together`): `evaluate_batch`
    steps the sequences together where each appends one token (`_step_each`), else one
    after another; the rest is the draft's own."""

    can_batch = True

    def __init__(self, draft: ConditionedDraft) -> None:
        self._draft = draft
        self.identity, self.geometry = draft.identity, draft.geometry

    @property
    def vocab_size(self) -> int:
        return self._draft.vocab_size

    @property
    def length(self) -> int:
        return self._draft.length

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        return self._draft.evaluate(tokens)

    def rollback(self, n: int) -> None:
        self._draft.rollback(n)

    def reset(self) -> None:
        self._draft.reset()

    def sequence(self) -> ConditionedDraft:
        return self._draft.fork()

    def evaluate_batch(
        self, work: Sequence[tuple[ConditionedDraft, Sequence[int]]]
    ) -> list[np.ndarray]:
        if len(work) > 1 and all(seq._steps_alone(tokens) for seq, tokens in work):
            return _step_each(work)
        return [seq.evaluate(tokens) for seq, tokens in work]


def _step_each(work: Sequence[tuple[ConditionedDraft, Sequence[int]]]) -> list[np.ndarray]:
    """One forward for several sequences of one draft, one new token each (branches drafting
    in lockstep): each reads its own keys in its window and its own feature, so each row is
    the row its `evaluate` gives (within float rounding: tests/proposer/test_conditioned.py)."""
    seqs = [seq for seq, _ in work]
    spec, width = seqs[0].spec, max(seq.length for seq in seqs)
    ids = np.array([check_tokens(tokens, seq.vocab_size) for seq, tokens in work], np.int64)
    feature = np.zeros((len(seqs), 1, spec.hidden_size), np.float32)
    positions = np.array([[seq.length] for seq in seqs], np.int64)
    allowed = np.zeros((len(seqs), width + 1), dtype=bool)
    allowed[:, width] = True  # each its own new key
    for b, seq in enumerate(seqs):
        start = seq.length
        feature[b, 0] = seq._step_feature(start)
        allowed[b, :start] = np.arange(start) > start - spec.window
    outs, logits, pasts = seqs[0]._engine.forward_each(
        ids, feature, positions, allowed, [seq._past for seq in seqs]
    )
    rows = []
    for b, seq in enumerate(seqs):
        seq._past = pasts[b]
        seq._outs = np.concatenate([seq._outs, outs[b]])
        seq._tokens.append(int(ids[b, 0]))
        row = np.full((1, seq.vocab_size), -np.inf)
        row[:, seq._head_ids] = logits[b].astype(np.float64)
        rows.append(row)
    return rows


def pair_check(draft: object, target: ModelIdentity, where: str) -> None:
    """Refuse `draft` against `target` when it is a conditioned draft trained for another."""
    if isinstance(draft, ConditionedDraft):
        draft.check_target(target, where)
