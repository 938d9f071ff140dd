"""Target backends (DESIGN.md §8): `torch` (default) and `vllm`.

Backends are imported lazily, so a verifier without one backend's libraries still loads
the others (vLLM lives in its own environment, `make vllm-env`).
"""

from __future__ import annotations

import inspect
import os
from typing import Literal

from muser.backend import ModelBackend
from muser.errors import InvalidOverrideError, UnknownBackendError

TargetKind = Literal["torch", "vllm"]
TARGET_KINDS: tuple[TargetKind, ...] = ("torch", "vllm")
CAPTURE_KINDS: tuple[TargetKind, ...] = ("torch",)
"""Kinds with `evaluate_capture` (hidden rows of chosen layers); the others refuse capture."""


def check_options(cls: type, kind: str, opts: dict) -> None:
    """Refuse options the backend class does not take, listing the ones it does."""
    params = inspect.signature(cls.__init__).parameters
    known = sorted(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise InvalidOverrideError(
            f"{kind} backend does not take option(s) {unknown}; it takes {known}"
        )


def load_target_backend(
    kind: TargetKind, path: str | os.PathLike[str], **opts: object
) -> ModelBackend:
    """Load the target checkpoint at `path` on backend `kind`, with backend options."""
    if kind == "torch":
        from verifier_gx.backends.torch_backend import TorchBackend

        check_options(TorchBackend, kind, opts)
        return TorchBackend(path, **opts)
    if kind == "vllm":
        from verifier_gx.backends.vllm_backend import VllmBackend

        check_options(VllmBackend, kind, opts)
        return VllmBackend(path, **opts)
    raise UnknownBackendError(
        f"target backend {kind!r} is unknown; valid kinds are {', '.join(TARGET_KINDS)}"
    )


__all__ = ["CAPTURE_KINDS", "TARGET_KINDS", "TargetKind", "check_options", "load_target_backend"]
