"""Domain errors. Each names what was received and what was expected.

Every error carries the CLI exit code it maps to; the gRPC servicers map each class to one
status code (STYLE.md item 7). Validation never uses `assert`.
"""

from __future__ import annotations

from wal.errors import MuserError  # the base lives in the lowest layer: storage raises it too


class RefusedError(MuserError):
    """Input or configuration refused before anything was computed or written."""

    exit_code = 2


# --- round validation (docs/design.md §2): all raised before a single MT draw -------------------


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


class TreeTopologyError(RoundValidationError):
    """A tree round whose parents, siblings, size or accepted path no round can carry."""


class TreeUnsupportedError(RefusedError):
    """A tree round sent where trees are not judged (a verifier whose target does not
    evaluate token trees, or a session that captures hidden rows)."""


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


# --- the verifier's sessions and round transaction (docs/design.md §6, §7) ------------------------
# Each maps to one gRPC status in verifier_gx/servicer.py (the table is there).


class UnknownSessionError(RefusedError):
    """A session id the verifier never opened."""


class SessionClosedError(RefusedError):
    """A session that was closed; its id is never reused."""


class SessionConflictError(RefusedError):
    """A different SessionOpen under an id that is already open."""


class SessionLimitError(RefusedError):
    """Opening one more session would exceed limits.max_sessions."""


class SessionFinishedError(RefusedError):
    """A round for a session that already emitted max_tokens or a stop token."""


class UnenrolledKeyError(RefusedError):
    """A proposer key that is not enrolled (or not the key that opened the session)."""


class StaleEpochError(RefusedError):
    """A fencing epoch lower than the session's: another proposer took the session over."""


class FutureEpochError(RefusedError):
    """A fencing epoch higher than the session's without an open at that epoch."""


class EquivocationError(RefusedError):
    """A different request at an already committed (session, round)."""


class RoundOutOfOrderError(RefusedError):
    """A round index other than the session's next round."""


class HeadMismatchError(RefusedError):
    """A request whose expected head is not the session's head."""


class GenesisMismatchError(RefusedError):
    """The genesis head a proposer sent differs from the one recomputed from its open."""


class FrontierMismatchError(RefusedError):
    """A request's frontier is not the last token of the committed transcript."""


class MissingFragmentsError(RefusedError):
    """Fragments a message names that the receiver does not hold; send them and retry."""

    def __init__(self, message: str, missing: list[bytes]) -> None:
        super().__init__(message)
        self.missing = list(missing)


class FragmentHashMismatchError(RefusedError):
    """Fragment bytes that do not hash to the digest they came with."""


class FragmentLimitError(RefusedError):
    """A session's staged, unacknowledged fragments would pass the verifier's limit."""


class FragmentMismatchError(RefusedError):
    """A well-formed fragment whose content disagrees with the committed session."""


class ResumeMismatchError(RefusedError):
    """A resume point (the last committed round an open carries) that does not belong to the
    session being opened: another session's round, an epoch ahead of the open's, a head that
    is not its own record's hash, a finished session."""


class DraftOverrunError(RoundValidationError):
    """More drafts than the session may still emit (a round emits up to D + 1 tokens)."""


class DecodeLengthError(RoundValidationError):
    """A decode_len the round may not ask for: < 1, > 1 with drafts, past what the session
    may still emit, over the lane's decode_len, or on a session that captures hidden rows."""


class LookupRuleError(RoundValidationError):
    """A decode round's lookup rule (`RoundRequest.lookup`) the verifier may not follow: on a
    round with drafts, or an n outside [1, muser.lookup.LOOKUP_MAX_N], or min_n > max_n."""


class InvalidPromptError(RefusedError):
    """A prompt fragment that is empty or not a whole number of u32 token ids."""


class NotAttachedError(RefusedError):
    """A round stream message before Attach, or for a session the stream is not attached to."""


class JournalError(RefusedError):
    """Commit-log entries that do not replay: a broken hash chain, a bad signature, an
    entry for an unknown session. The daemon refuses to start on such a log."""
