"""The model-backend contract both sides agree on.

A backend holds one causal LM and the KV cache of one sequence. `evaluate(tokens)` appends
`tokens` to the cached sequence and returns one float64 row of raw logits per appended token:
row i is the model's next-token logits after `tokens[i]`. `rollback(n)` drops the last `n`
tokens from the cache. Rows are raw logits; every transform (temperature, top-k, top-p,
normalisation) happens on the host in float64 (`muser.sampling`).

Target backends (`verifier_gx.backends`) and draft backends (`proposer_mac.backends`)
implement the same contract, so one contract test suite runs against all of them.

Optional capability, `MultiSequenceBackend` (the verifier serves many sessions on one model):
`sequence()` returns a new `ModelBackend` over the same weights with its own, empty KV, and
`evaluate_batch([(sequence, tokens), ...])` appends each `tokens` to its sequence in one
forward, returning each sequence's rows exactly as `sequence.evaluate(tokens)` would (up to
float rounding). A backend without it (vLLM, the test fakes) still serves many sessions: they
share its one KV, re-evaluated when sessions interleave (`muser.cursor`), and
`evaluate_batch` below runs the sequences one after another.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from muser.errors import InvalidOverrideError


@dataclass(frozen=True)
class ModelIdentity:
    """Who a model is, bit for bit.

    `model_digest` is SHA-256 over config, weights and tokenizer files; `tokenizer_digest`
    over the tokenizer files alone (draft and target must share it).
    """

    model_digest: str
    tokenizer_digest: str
    vocab_size: int
    architecture: str
    path: str


@dataclass(frozen=True)
class Geometry:
    """Geometry read from the checkpoint's own config (docs/design.md §9), after overrides."""

    context_length: int
    num_layers: int
    hidden_size: int
    rope_theta: float | None
    sliding_window: int | None


class HeldTokens:
    """What every one-KV backend reports alike (torch, vLLM, mlx): its vocabulary (the
    identity's), its length (the tokens it holds, `_tokens`) and where its rows are computed,
    "`label`:`device`" as `muser status` shows it ("torch:cuda:0", "vllm:cpu", "mlx:gpu")."""

    label: str
    identity: ModelIdentity
    device: str
    _tokens: list[int]
    defined_vocab: int | None = None
    """As a draft: the ids past which its rows are -inf (`mask_undefined`); None: none."""
    unknown_id: int | None = None
    """As a draft: the id it reads in place of a token past its embedding (one of a wider
    target's padding ids); None: such a token is refused (`check_tokens`)."""

    @property
    def device_label(self) -> str:
        return f"{self.label}:{self.device}"

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def length(self) -> int:
        return len(self._tokens)


@runtime_checkable
class ModelBackend(Protocol):
    identity: ModelIdentity
    geometry: Geometry

    @property
    def vocab_size(self) -> int: ...

    @property
    def length(self) -> int:
        """Number of tokens whose KV is in the cache."""
        ...

    def evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Append `tokens`; return float64 logits of shape (len(tokens), vocab_size)."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last `n` tokens of KV; refuses n < 0 or n > length (RollbackError)."""
        ...

    def reset(self) -> None:
        """Drop the whole cache."""
        ...


@runtime_checkable
class MultiSequenceBackend(ModelBackend, Protocol):
    """A backend holding many sequences' KV over one model's weights (see the module doc)."""

    @property
    def can_batch(self) -> bool:
        """False when this model cannot take the batched path (`sequence()` then refuses)."""
        ...

    def sequence(self) -> ModelBackend:
        """A new sequence with an empty KV over the same weights."""
        ...

    def evaluate_batch(
        self, work: Sequence[tuple[ModelBackend, Sequence[int]]]
    ) -> list[np.ndarray]:
        """Append each `tokens` to its sequence (made by `sequence()`) in one forward. On an
        error a sequence may keep what it appended; its `length` says so (callers roll back)."""
        ...


def batches(backend: object) -> bool:
    """Whether `backend` offers per-sequence KV and batched forwards. Asked every round;
    the structural check (an `isinstance` against a runtime protocol, some 30 µs: it looks
    up every member) is made once per backend class."""
    kind = type(backend)
    multi = _MULTI.get(kind)
    if multi is None:
        multi = isinstance(backend, MultiSequenceBackend)
        if not hasattr(kind, "__getattr__"):  # a proxy answers as what it wraps: asked each time
            _MULTI[kind] = multi
    return multi and bool(backend.can_batch)  # type: ignore[attr-defined]


_MULTI: dict[type, bool] = {}
"""`batches`' structural answer per backend class."""


def trees_on_held(backend: object) -> bool:
    """Whether `backend` holds one sequence and evaluates token trees on it
    (`evaluate_tree(backend, ...)`, `keep_path`: vLLM, a request per branch), so tree
    rounds run on it although its sessions share one KV."""
    return bool(getattr(backend, "trees_on_held", False))


def tree_evaluator(seq: object) -> object:
    """What evaluates token trees on the sequence `seq` (`evaluate_tree(seq, ...)`): `seq`
    itself where it holds its one sequence (`trees_on_held`: vLLM, a conditioned draft),
    else the backend it is a sequence of (a torch sequence's `owner`; None without one)."""
    return seq if trees_on_held(seq) else getattr(seq, "owner", None)


def evaluate_batch(
    backend: object, work: Sequence[tuple[ModelBackend, Sequence[int]]]
) -> list[np.ndarray]:
    """`backend.evaluate_batch(work)` when it batches; else each sequence's `evaluate` in turn."""
    if batches(backend):
        return backend.evaluate_batch(work)  # type: ignore[attr-defined]
    return [seq.evaluate(tokens) for seq, tokens in work]


def check_options(cls: type, kind: str, opts: dict) -> None:
    """Refuse options a backend class does not take, listing the ones it does (both daemons'
    loaders pass the cluster file's options through it)."""
    params = inspect.signature(cls.__init__).parameters
    known = sorted(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise InvalidOverrideError(
            f"{kind} backend does not take option(s) {unknown}; it takes {known}"
        )


def mask_undefined(logits: np.ndarray, defined: int | None) -> np.ndarray:
    """A draft's float64 rows with every id at or past `defined` set to -inf, in place: ids an
    embedding holds beyond the shared vocabulary (padding past the tokenizer, or past the
    target's rows) are never drafted. None: the rows as they are."""
    if defined is not None and defined < logits.shape[-1]:
        logits[..., defined:] = -np.inf
    return logits
