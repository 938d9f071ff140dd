"""Draft backend on MLX (Metal on a Mac, CPU elsewhere) with mlx-lm's prompt cache.

Implements `muser.backend.ModelBackend`. Nothing here assumes CPU: the device is chosen
once ("auto" takes Metal when present) and every computation runs on that device's stream.

Geometry comes from the checkpoint (`muser.geometry`) and is handed to mlx-lm explicitly,
because mlx-lm reads `rope_theta` only at the top level of config.json (transformers 5
nests it under `rope_parameters`, and a llama config without it silently gets 10000).
Some mlx-lm models (llama, which also serves mistral) ignore a uniform `sliding_window`;
for those the context is capped at the window, so this backend refuses where it would
otherwise diverge from the target instead of drafting from a different model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from muser.backend import Geometry, HeldTokens, ModelIdentity, mask_undefined
from muser.errors import ContextOverflowError, InvalidOverrideError, ModelLoadError
from muser.geometry import check_rollback, check_room, check_tokens, read_geometry
from muser.identity import config_value, model_identity, read_config

Device = Literal["auto", "cpu", "gpu"]
DEVICES: tuple[Device, ...] = ("auto", "cpu", "gpu")


def choose_device(device: Device) -> str:
    """ "auto" → "gpu" when MLX has one (Metal on a Mac), else "cpu"; "gpu" without one is
    refused, naming the setting to change (`proposer.device` in cluster.toml)."""
    import mlx.core as mx

    if device not in DEVICES:
        raise InvalidOverrideError(f"device {device!r} is not one of {DEVICES}")
    has_gpu = mx.is_available(mx.gpu)
    if device == "auto":
        return "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        raise InvalidOverrideError(
            "device 'gpu' requested (proposer.device) but MLX has no GPU on this machine "
            f'(Metal available: {mx.metal.is_available()}): set proposer.device = "cpu", or '
            '"auto" (Metal when present, else CPU)'
        )
    return device


def _mlx_overrides(config: dict, geometry: Geometry) -> dict:
    """Config entries mlx-lm must see at the top level for the model to match the target."""
    overrides: dict = {}
    if geometry.rope_theta is not None:
        overrides["rope_theta"] = geometry.rope_theta
    rope = config_value(config, "rope_parameters")
    scaled = isinstance(rope, dict) and rope.get("rope_type", "default") != "default"
    if scaled and config_value(config, "rope_scaling") is None:
        overrides["rope_scaling"] = dict(rope)
    return overrides


def _honours_sliding_window(model) -> bool:
    return any(
        getattr(layer, "use_sliding", False) or getattr(layer, "is_sliding", False)
        for layer in getattr(model, "layers", [])
    )


class MlxBackend(HeldTokens):
    """A causal LM under mlx-lm with the prompt cache of one sequence (`ModelBackend`)."""

    label = "mlx"
    identity: ModelIdentity
    geometry: Geometry

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: Device = "auto",
        context_length: int | None = None,
        rope_theta: float | None = None,
    ) -> None:
        import mlx.core as mx

        self.device = choose_device(device)
        self._mx = mx
        self._stream = mx.gpu if self.device == "gpu" else mx.cpu
        self.identity = model_identity(path)
        self.geometry = read_geometry(path, context_length=context_length, rope_theta=rope_theta)
        self._model = self._load(Path(path).expanduser())
        self._limit, self._limit_note = self._context_limit()
        self._tokens: list[int] = []
        self._cache = self._new_cache()

    def _load(self, path: Path):
        from mlx_lm.utils import load_model

        overrides = _mlx_overrides(read_config(path), self.geometry)
        try:
            with self._mx.stream(self._stream):
                model, _ = load_model(path, model_config=overrides)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{path}: mlx-lm could not load the checkpoint ({exc})") from exc
        return model

    def _context_limit(self) -> tuple[int, str]:
        ctx, window = self.geometry.context_length, self.geometry.sliding_window
        if window is None or window >= ctx or _honours_sliding_window(self._model):
            return ctx, ""
        note = f" (capped at sliding_window {window}: this mlx-lm model ignores the window)"
        return window, note

    def _new_cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self._model)

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; float64 logits (len(tokens), vocab_size), positions from `length`."""
        ids = check_tokens(tokens, self.vocab_size, self.unknown_id)
        try:
            check_room(self.length, len(ids), self._limit)
        except ContextOverflowError as exc:
            raise ContextOverflowError(f"{exc}{self._limit_note}") from None
        if not ids:
            return np.zeros((0, self.vocab_size))
        try:
            rows = self._forward(ids)
        except BaseException:
            self._cut_to_tokens()
            raise
        self._tokens.extend(ids)
        return rows

    def _cut_to_tokens(self) -> None:
        """After a forward that failed part-way (the layer caches it reached advanced their
        offsets, the others not): every layer back to the tokens this backend holds,
        trimmed where it can be, else the cache rebuilt from them."""
        held = len(self._tokens)
        if all(getattr(c, "is_trimmable", lambda: False)() for c in self._cache):
            for c in self._cache:
                extra = c.offset - held
                if extra > 0:
                    c.trim(extra)
            return
        tokens = list(self._tokens)
        self.reset()
        if tokens:
            self._forward(tokens)
            self._tokens = tokens

    def _forward(self, ids: list[int]) -> np.ndarray:
        mx = self._mx
        with mx.stream(self._stream):
            logits = self._model(mx.array([ids]), cache=self._cache)
            logits = logits[0, :, : self.vocab_size].astype(mx.float32)
            mx.eval(logits)
        return mask_undefined(np.array(logits, dtype=np.float64), self.defined_vocab)

    def fork(self) -> MlxBackend:
        """An empty sequence over the same weights, through this very forward (the proposer
        gives each session its own draft KV with it)."""
        twin = copy.copy(self)
        twin._cache, twin._tokens = self._new_cache(), []
        return twin

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens: trim the cache, or rebuild it when it cannot be trimmed."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        check_rollback(n, self.length)
        if n == 0:
            return
        kept = self._tokens[:-n]
        if can_trim_prompt_cache(self._cache) and trim_prompt_cache(self._cache, n) == n:
            self._tokens = kept
            return
        # A rotating (sliding-window) cache that has wrapped cannot be trimmed: replay.
        self.reset()
        if kept:
            self._forward(kept)
            self._tokens = kept

    def reset(self) -> None:
        """Drop the whole cache."""
        self._cache = self._new_cache()
        self._tokens = []
