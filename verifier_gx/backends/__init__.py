"""Target backends (docs/design.md §9): `torch` (default) and `vllm`.

Backends are imported lazily, so a verifier without one backend's libraries still loads
the others (vLLM lives in its own environment, `make vllm-env`).
"""

from __future__ import annotations

import os
from typing import Literal

from muser.backend import ModelBackend, check_options
from muser.errors import UnknownBackendError

TargetKind = Literal["torch", "vllm"]
TARGET_KINDS: tuple[TargetKind, ...] = ("torch", "vllm")
CAPTURE_KINDS: tuple[TargetKind, ...] = ("torch", "vllm")
"""Kinds with `evaluate_capture` (hidden rows of chosen layers); the others refuse capture."""


def load_target_backend(
    kind: TargetKind, path: str | os.PathLike[str], **opts: object
) -> ModelBackend:
    """Load the target checkpoint at `path` on backend `kind`, with backend options."""
    if kind == "torch":
        from muser_torch.backend import TorchBackend

        check_options(TorchBackend, kind, opts)
        return TorchBackend(path, **opts)
    if kind == "vllm":
        from verifier_gx.backends.vllm_backend import VllmBackend

        check_options(VllmBackend, kind, opts)
        return VllmBackend(path, **opts)
    raise UnknownBackendError(
        f"target backend {kind!r} is unknown; valid kinds are {', '.join(TARGET_KINDS)}"
    )


def target_options(verifier) -> dict[str, object]:
    """The backend options a cluster file's [verifier] names: device and dtype for either
    kind, the forward for torch (vLLM runs its own)."""
    opts: dict[str, object] = {"device": verifier.device, "dtype": verifier.dtype}
    if verifier.backend == "torch":
        opts["forward"] = verifier.forward
    return opts


__all__ = [
    "CAPTURE_KINDS",
    "TARGET_KINDS",
    "TargetKind",
    "load_target_backend",
    "target_options",
]
