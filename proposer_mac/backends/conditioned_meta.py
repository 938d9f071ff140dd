"""What a feature-conditioned draft checkpoint declares about itself (docs/conditioned.md, docs/design.md §9).

The checkpoint is a directory like any other (config.json, model.safetensors, the target's
tokenizer files), whose config.json carries, under `muser_conditioned`, everything the
proposer must not guess: the target it was trained for (identity digests), the capture
layers it reads, the attention window and the feature dtype it was trained with, and its own
geometry. Every value is read from there; `capture_layers`, `window` and `feature_dtype` may
be overridden (each refused when it cannot apply), and a draft is refused against any target
but its own, naming both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from muser.backend import ModelIdentity
from muser.errors import InvalidOverrideError, ModelLoadError, RefusedError
from muser.identity import CONDITIONED_META_KEY

ARCHITECTURE = "MuserConditionedDraft"
META_KEY = CONDITIONED_META_KEY
FeatureDtype = Literal["float16", "float32"]
FEATURE_DTYPES: tuple[FeatureDtype, ...] = ("float16", "float32")


class TargetBinding(BaseModel):
    """The target the draft was trained against (`muser.identity.model_identity`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_digest: str
    tokenizer_digest: str
    architecture: str
    num_layers: int = Field(ge=1)


class ConditionedSpec(BaseModel):
    """A conditioned draft's metadata and geometry (config.json's `muser_conditioned`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    target: TargetBinding
    capture_layers: tuple[int, ...] = Field(min_length=1)
    """The target's decoder layers whose output rows the draft reads, low to high."""
    window: int = Field(ge=1)
    """The attention span (positions) the draft was trained with."""
    feature_dtype: FeatureDtype
    """The precision feature rows are rounded to before the draft reads them (the wire's)."""
    vocab_size: int = Field(ge=1)
    context_length: int = Field(ge=1)
    """The target's context window (the draft's positions follow the target's)."""
    target_hidden_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    rope_theta: float = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    head_size: int = Field(ge=1)
    """Rows of the reduced-vocabulary head."""

    @model_validator(mode="after")
    def _consistent(self) -> ConditionedSpec:
        layers = self.capture_layers
        if list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"capture_layers {list(layers)}: expected distinct ascending ids ≥ 0")
        if layers[-1] >= self.target.num_layers:
            raise ValueError(
                f"capture_layers {list(layers)}: the target has {self.target.num_layers} layers"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not group into {self.num_kv_heads}")
        if self.head_size > self.vocab_size:
            raise ValueError(f"head_size {self.head_size} exceeds vocab_size {self.vocab_size}")
        return self


def read_spec(path: str | Path) -> ConditionedSpec:
    """The spec a checkpoint declares; ModelLoadError when it is not a conditioned draft."""
    config_path = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: unreadable ({exc})") from exc
    if META_KEY not in config:
        raise ModelLoadError(
            f"{path}: not a conditioned draft (config.json has no `{META_KEY}`; its "
            f"architectures are {config.get('architectures')})"
        )
    try:
        return ConditionedSpec.model_validate(config[META_KEY])
    except ValidationError as exc:
        raise ModelLoadError(f"{config_path}: invalid `{META_KEY}`: {exc}") from exc


def is_conditioned(path: str | Path) -> bool:
    """Whether the checkpoint at `path` declares itself a conditioned draft."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return META_KEY in config


def with_overrides(
    spec: ConditionedSpec,
    *,
    capture_layers: tuple[int, ...] | None = None,
    window: int | None = None,
    feature_dtype: str | None = None,
) -> ConditionedSpec:
    """`spec` with the given values in place of the declared ones, each checked: capture
    layers keep their count (the fusion's width is fixed) and stay inside the target; the
    window is ≥ 1; the dtype is one of FEATURE_DTYPES."""
    changes: dict = {}
    if capture_layers is not None:
        layers = tuple(int(i) for i in capture_layers)
        if len(layers) != len(spec.capture_layers):
            raise InvalidOverrideError(
                f"capture layers override {list(layers)}: the draft fuses "
                f"{len(spec.capture_layers)} layers (declared {list(spec.capture_layers)})"
            )
        changes["capture_layers"] = layers
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidOverrideError(f"window override {window!r}: expected an integer ≥ 1")
        changes["window"] = window
    if feature_dtype is not None:
        if feature_dtype not in FEATURE_DTYPES:
            raise InvalidOverrideError(
                f"feature dtype override {feature_dtype!r}: expected one of {FEATURE_DTYPES}"
            )
        changes["feature_dtype"] = feature_dtype
    if not changes:
        return spec
    try:
        return ConditionedSpec.model_validate({**spec.model_dump(), **changes})
    except ValidationError as exc:
        raise InvalidOverrideError(f"override {changes}: {exc.errors()[0]['msg']}") from exc


def check_target(spec: ConditionedSpec, target: ModelIdentity, where: str) -> None:
    """Refuse a target other than the one the draft was trained for, naming both (`target`:
    a ModelIdentity, or the proposer's identity of a target it has no files of)."""
    mine = spec.target
    if target.model_digest != mine.model_digest:
        about = ", ".join(
            str(v)
            for v in (getattr(target, "architecture", None), getattr(target, "path", None))
            if v
        )
        raise RefusedError(
            f"{where}: the conditioned draft was trained for target {mine.model_digest[:16]} "
            f"({mine.architecture}), but the target is {target.model_digest[:16]}"
            f"{f' ({about})' if about else ''}: features of another model mean nothing to it; "
            "train one for this target (docs/conditioned.md)"
        )
