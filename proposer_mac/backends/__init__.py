"""Draft backends (DESIGN.md §8): `mlx` (Metal on a Mac, CPU elsewhere) and `torch`.

Backends are imported lazily, so a proposer without torch can still run the mlx draft.
"""

from __future__ import annotations

import os
from typing import Literal

from muser.backend import ModelBackend, check_options
from muser.errors import UnknownBackendError

DraftKind = Literal["mlx", "torch"]
DRAFT_KINDS: tuple[DraftKind, ...] = ("mlx", "torch")


def _draft_class(kind: str) -> type:
    if kind == "mlx":
        from proposer_mac.backends.mlx_draft import MlxBackend

        return MlxBackend
    if kind == "torch":
        from proposer_mac.backends.torch_draft import TorchDraftBackend

        return TorchDraftBackend
    raise UnknownBackendError(
        f"draft backend {kind!r} is unknown; valid kinds are {', '.join(DRAFT_KINDS)}"
    )


def load_draft_backend(
    kind: DraftKind,
    path: str | os.PathLike[str],
    *,
    window: int | None = None,
    **opts: object,
) -> ModelBackend:
    """Load the draft checkpoint at `path` on backend `kind`.

    `window` is `--draft-window N`: when given, every row attends only to the last N tokens
    (`WindowedBackend`). Other options go to the backend's constructor.
    """
    cls = _draft_class(kind)
    check_options(cls, kind, opts)
    backend = cls(path, **opts)
    if window is None:
        return backend
    from proposer_mac.backends.windowed import WindowedBackend

    return WindowedBackend(backend, window)


__all__ = ["DRAFT_KINDS", "DraftKind", "load_draft_backend"]
