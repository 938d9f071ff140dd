"""Geometry read from the checkpoint's own config.json, never hard-coded (docs/design.md §9).

Overrides are explicit keyword arguments; an override of an invalid value is refused with a
message that quotes it. Values in config.json are checked the same way, so a broken
checkpoint fails at load rather than deep inside a round.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from pathlib import Path

from muser.backend import Geometry
from muser.errors import (
    ContextOverflowError,
    InvalidOverrideError,
    ModelLoadError,
    RollbackError,
    TokenOutOfVocabularyError,
)
from muser.identity import config_value, read_config

# No released model comes near 2**24 positions; a bigger value is a typo or a unit mix-up.
MAX_CONTEXT_LENGTH = 1 << 24


def _positive_int(name: str, value: object, *, source: str, limit: int | None = None) -> int:
    error = InvalidOverrideError if source == "override" else ModelLoadError
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} {source} {value!r} is invalid: expected an integer ≥ 1")
    if limit is not None and value > limit:
        raise error(f"{name} {source} {value!r} is invalid: expected at most {limit}")
    return value


def _positive_float(name: str, value: object, *, source: str) -> float:
    error = InvalidOverrideError if source == "override" else ModelLoadError
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise error(f"{name} {source} {value!r} is invalid: expected a finite number > 0")
    return float(value)


def config_rope_theta(config: dict) -> float | None:
    """Top-level `rope_theta` (transformers 4, mlx-lm) or `rope_parameters.rope_theta` (5)."""
    theta = config_value(config, "rope_theta")
    if theta is not None:
        return theta
    params = config_value(config, "rope_parameters") or {}
    if "rope_theta" in params:
        return params["rope_theta"]
    # Per-layer-type parameters (e.g. {"full_attention": {...}, "sliding_attention": {...}}).
    full = params.get("full_attention")
    return full.get("rope_theta") if isinstance(full, dict) else None


def config_sliding_window(config: dict) -> int | None:
    """`sliding_window`, unless the config switches it off (`use_sliding_window: false`)."""
    if config_value(config, "use_sliding_window") is False:
        return None
    return config_value(config, "sliding_window")


def read_geometry(
    path: str | os.PathLike[str],
    *,
    context_length: int | None = None,
    rope_theta: float | None = None,
    sliding_window: int | None = None,
) -> Geometry:
    """Geometry of the checkpoint at `path`, with explicit overrides applied."""
    config = read_config(Path(path).expanduser())
    src = "in config.json"
    ctx = _positive_int(
        "max_position_embeddings",
        config_value(config, "max_position_embeddings"),
        source=src,
        limit=MAX_CONTEXT_LENGTH,
    )
    layers = _positive_int(
        "num_hidden_layers", config_value(config, "num_hidden_layers"), source=src
    )
    hidden = _positive_int("hidden_size", config_value(config, "hidden_size"), source=src)
    theta = config_rope_theta(config)
    theta = None if theta is None else _positive_float("rope_theta", theta, source=src)
    window = config_sliding_window(config)
    window = None if window is None else _positive_int("sliding_window", window, source=src)

    if context_length is not None:
        ctx = _positive_int(
            "context_length", context_length, source="override", limit=MAX_CONTEXT_LENGTH
        )
    if rope_theta is not None:
        if theta is None:
            raise InvalidOverrideError(
                f"rope_theta override {rope_theta!r} refused: the checkpoint has no rope parameters"
            )
        theta = _positive_float("rope_theta", rope_theta, source="override")
    if sliding_window is not None:
        window = _positive_int("sliding_window", sliding_window, source="override")
    return Geometry(
        context_length=ctx,
        num_layers=layers,
        hidden_size=hidden,
        rope_theta=theta,
        sliding_window=window,
    )


# --- checks every backend applies before touching its model -------------------------------


def check_tokens(tokens: Sequence[int], vocab_size: int, unknown: int | None = None) -> list[int]:
    """Tokens as plain ints; refuse ids outside [0, vocab_size) before touching the model.
    With `unknown` (a draft reading a target whose embedding is wider: its padding ids), an
    id past the vocabulary reads as `unknown` instead: a draft's input is only a hint."""
    ids = []
    for t in tokens:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise TokenOutOfVocabularyError(f"token id {t!r} is not an integer") from None
    if unknown is not None:
        ids = [unknown if t >= vocab_size else t for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise TokenOutOfVocabularyError(
            f"token id {bad[0]} outside [0, {vocab_size}) ({len(bad)} such ids)"
        )
    return ids


def check_room(length: int, adding: int, context_length: int) -> None:
    """Refuse a sequence that would exceed the context window, naming both numbers."""
    if length + adding > context_length:
        raise ContextOverflowError(
            f"evaluating {adding} tokens after {length} would hold {length + adding} tokens; "
            f"context_length is {context_length}"
        )


def check_rollback(n: int, length: int) -> None:
    """Rollback must drop between 0 and `length` tokens."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > length:
        raise RollbackError(f"rollback of {n!r} tokens refused: the cache holds {length}")
