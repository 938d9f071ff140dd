"""Draft backends (docs/design.md §9): `mlx` (Metal on a Mac, CPU elsewhere), `torch`, the
feature-conditioned `conditioned` (reads the target's capture rows), and the model-free
`ngram` (prompt lookup; its path is the target's checkpoint).

Backends are imported lazily, so a proposer without torch can still run the mlx draft.
"""

from __future__ import annotations

import os
from typing import Literal

from muser.backend import ModelBackend, check_options
from muser.errors import UnknownBackendError

DraftKind = Literal["mlx", "torch", "conditioned", "ngram"]
DRAFT_KINDS: tuple[DraftKind, ...] = ("mlx", "torch", "conditioned", "ngram")


def _draft_class(kind: str) -> type:
    if kind == "mlx":
        from proposer_mac.backends.mlx_draft import MlxBackend

        return MlxBackend
    if kind == "torch":
        from proposer_mac.backends.torch_draft import TorchDraftBackend

        return TorchDraftBackend
    if kind == "conditioned":
        from proposer_mac.backends.conditioned import ConditionedDraft

        return ConditionedDraft
    if kind == "ngram":
        from proposer_mac.backends.ngram import NgramDraft

        return NgramDraft
    raise UnknownBackendError(
        f"draft backend {kind!r} is unknown; valid kinds are {', '.join(DRAFT_KINDS)}"
    )


def draft_options(kind: str, *, device: str, dtype: str) -> dict[str, str]:
    """The options the cluster file's [proposer] gives a draft backend of `kind`: the mlx
    device, the torch dtype, nothing for the n-gram draft (no weights)."""
    return {"mlx": {"device": device}, "torch": {"dtype": dtype}}.get(kind, {})


def load_draft_backend(
    kind: DraftKind,
    path: str | os.PathLike[str],
    *,
    window: int | None = None,
    **opts: object,
) -> ModelBackend:
    """Load the draft checkpoint at `path` on backend `kind`.

    `window` is `--draft-window N`: when given, every row attends only to the last N tokens
    (`WindowedBackend`; the conditioned draft takes it as an override of the window its
    checkpoint declares). Other options go to the backend's constructor.
    """
    cls = _draft_class(kind)
    if kind == "conditioned":
        opts = {**opts, "window": window}
        window = None
    check_options(cls, kind, opts)
    backend = cls(path, **opts)
    if window is None:
        return backend
    from proposer_mac.backends.windowed import WindowedBackend

    return WindowedBackend(backend, window)


def limit_to_target(draft: ModelBackend, target_vocab: int) -> None:
    """Draft only ids both sides define: those of the draft's own vocabulary (an embedding
    padded past its tokenizer holds more) that the target's rows reach (`target_vocab`, its
    `vocab_size`). And read a token past the draft's embedding (a wider target's padding id,
    which the target may emit) as the draft's end-of-sequence token: a draft's input is only
    a hint, so it costs acceptance, never exactness. A backend without these settings
    (n-gram lookup proposes tokens it has seen; a conditioned draft its head's) is left as
    it is."""
    if not hasattr(draft, "defined_vocab"):
        return
    from muser.vocabulary import load_vocabulary

    vocabulary = load_vocabulary(draft.identity.path)
    defined = min(max(vocabulary.tokens) + 1, target_vocab)
    if defined < draft.vocab_size:
        draft.defined_vocab = defined
    if target_vocab > draft.vocab_size:
        draft.unknown_id = vocabulary.special.get("eos", 0)


__all__ = ["DRAFT_KINDS", "DraftKind", "draft_options", "limit_to_target", "load_draft_backend"]
