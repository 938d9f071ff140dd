"""The feature-conditioned draft as a `ModelBackend` (DESIGN.md §4.2; docs/conditioned.md).

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

Rows are float64 logits over the target's vocabulary, -inf outside the draft's reduced head.
Attention sees the last `window` positions (the checkpoint's, or the override's).

`runtime` picks the network's implementation: `torch` (`conditioned_torch`, also the trainer's)
or `mlx` (`conditioned_mlx`, Metal on a Mac); both compute the same rows from the same weights.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity
from muser.errors import InvalidOverrideError, ModelLoadError, RefusedError
from muser.geometry import check_rollback, check_room, check_tokens
from muser.identity import model_identity
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
        return self._known > 0

    def fork(self) -> ConditionedDraft:
        """An empty sequence over the same network (one per session on the proposer)."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    @property
    def features_known(self) -> int:
        """Positions 0..n-1 whose target rows are installed (contiguous from 0)."""
        return self._known

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
        if first < 0 or first > self._known:
            raise RefusedError(
                f"features from position {first} received; {self._known} are known, so the "
                f"next must start at or before {self._known}"
            )
        if n == 0:
            return
        end = first + n
        if end > len(self._features):
            grown = np.zeros((max(end, 2 * len(self._features)), self._width), np.float32)
            grown[: self._known] = self._features[: self._known]
            self._features = grown
        row = np.concatenate(parts, axis=1).astype(self._round).astype(np.float32)
        self._features[first:end] = row
        self._known = max(self._known, end)

    # ---- the contract -------------------------------------------------------------------

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        ids = check_tokens(tokens, self.vocab_size)
        check_room(self.length, len(ids), self.geometry.context_length)
        stale = self._first_self
        if stale is not None and stale - 1 < self._known:  # its target rows arrived
            held = self._tokens[stale:]
            self._drop(len(held))
            self._append(held)
        return self._append(ids)

    def rollback(self, n: int) -> None:
        check_rollback(n, self.length)
        self._drop(n)

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._past = None
        self._outs = np.zeros((0, self.spec.hidden_size), np.float32)
        self._first_self: int | None = None
        """The first held position computed with the draft's own feature (None: none)."""
        self._features = np.zeros((0, self._width), np.float32)
        self._known = 0

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
            while stop < start + len(ids) - done and stop - 1 < self._known:
                stop += 1
            out[done : done + stop - start, self._head_ids] = self._forward(
                ids[done : done + stop - start], start
            )
            done += stop - start
        return out

    def _forward(self, ids: list[int], start: int) -> np.ndarray:
        n, engine = len(ids), self._engine
        feature = np.zeros((1, n, self.spec.hidden_size), np.float32)
        real = [p for p in range(start, start + n) if 0 <= p - 1 < self._known]
        if real:
            rows = self._features[real[0] - 1 : real[-1]]
            feature[0, real[0] - start :] = engine.fuse_features(rows)
        if start > 0 and start - 1 >= self._known:  # the draft's own row at start - 1
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


def pair_check(draft: object, target: ModelIdentity, where: str) -> None:
    """Refuse `draft` against `target` when it is a conditioned draft trained for another."""
    if isinstance(draft, ConditionedDraft):
        draft.check_target(target, where)
