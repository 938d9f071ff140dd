"""Domain errors. Each names what was received and what was expected.

Every error carries the CLI exit code it maps to; the gRPC servicers map each class to one
status code (STYLE.md item 7). Validation never uses `assert`.
"""

from __future__ import annotations


class MuserError(Exception):
    """Base of every error this project raises on purpose."""

    exit_code = 3


class RefusedError(MuserError):
    """Input or configuration refused before anything was computed or written."""

    exit_code = 2


# --- round validation (DESIGN.md §4): all raised before a single MT draw -------------------


class RoundValidationError(RefusedError):
    """A round's geometry or values are invalid; nothing was drawn."""


class RowCountError(RoundValidationError):
    """Wrong number of draft rows or witness rows for the number of drafts."""


class RowWidthError(RoundValidationError):
    """A witness row's width differs from the vocabulary size."""


class TokenOutOfVocabularyError(RoundValidationError):
    """A token id (frontier, draft or sparse-row id) outside [0, vocab_size)."""


class DraftZeroProbabilityError(RoundValidationError):
    """A drafted token has draft probability q = 0 (or is absent from its sparse row)."""


class InvalidWeightsError(RoundValidationError):
    """NaN, infinite, negative or all-zero weights in a row."""


class DraftMismatchError(RoundValidationError):
    """The replayed draft draws do not select the drafts the request declares."""


class InvalidSamplingParamsError(RefusedError):
    """Temperature < 0, top-p outside (0, 1], top-k < 0, max tokens < 1, ..."""


# --- models ----------------------------------------------------------------------------------


class ModelLoadError(MuserError):
    """A checkpoint could not be loaded (missing files, unsupported architecture)."""


class ModelMismatchError(RefusedError):
    """Draft and target disagree on tokenizer or vocabulary, or an identity differs."""


class ContextOverflowError(RefusedError):
    """A sequence would exceed the model's context window."""


class RollbackError(RefusedError):
    """A rollback asked to drop more tokens than the cache holds (or a negative count)."""


class InvalidOverrideError(RefusedError):
    """A geometry override or backend knob (context length, rope theta, window) is invalid."""


class CaptureLayerError(RefusedError):
    """A capture asked for a decoder layer index outside [0, num_layers)."""


class UnknownBackendError(RefusedError):
    """A backend kind that is not one of the implemented kinds."""
