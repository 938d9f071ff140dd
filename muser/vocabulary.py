"""A tokenizer's vocabulary, and whether a draft's and a target's agree (docs/design.md §9).

Compatibility is decided on what the tokens are, not on file bytes: every id's token string,
the added tokens and which ids begin and end a sequence (BOS, EOS). Two tokenizers are
compatible when they agree on every id both define and every token string both define, as
llama.cpp's `common_speculative_are_compatible` and vLLM's draft checks see it: a re-saved
tokenizer.json, or an MLX conversion's copy, is the same vocabulary; a config whose
`vocab_size` pads the embedding past the tokenizer (152,064 rows for 151,643 tokens) changes
nothing here. `vocabulary_digest` names a vocabulary by its content, so equal digests mean
the same vocabulary whatever the files look like.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from muser.errors import ModelLoadError, ModelMismatchError

VOCABULARY_DOMAIN = b"muser.vocabulary.v1\x00"
SPECIAL_ROLES = ("bos", "eos")
"""The special tokens generation depends on: the one a prompt may begin with, the one that
ends it (a tokenizer class's padding and unknown tokens change no generated token)."""


@dataclass(frozen=True)
class Vocabulary:
    tokens: dict[int, str]
    """Every id the tokenizer defines (its base vocabulary and added tokens) -> its string."""
    special: dict[str, int]
    """Role (bos, eos) -> id, for the roles the tokenizer names."""

    def digest(self) -> str:
        body = json.dumps(
            [sorted(self.tokens.items()), sorted(self.special.items())],
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return hashlib.sha256(VOCABULARY_DOMAIN + body.encode("utf-8", "surrogatepass")).hexdigest()


def load_vocabulary(path: str | os.PathLike[str]) -> Vocabulary:
    """The vocabulary of the tokenizer in checkpoint directory `path` (transformers' own
    loader, as both daemons load it)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises OSError, ValueError, its own errors
        raise ModelLoadError(f"{path}: the tokenizer does not load ({exc})") from exc
    tokens = {int(i): str(t) for t, i in tok.get_vocab().items()}
    special = {
        role: int(i)
        for role in SPECIAL_ROLES
        if (i := getattr(tok, f"{role}_token_id", None)) is not None
    }
    return Vocabulary(tokens, special)


def vocabulary_digest(path: str | os.PathLike[str]) -> str:
    return load_vocabulary(path).digest()


def first_conflict(target: Vocabulary, draft: Vocabulary) -> str | None:
    """Where the two vocabularies disagree, in words naming the first differing id and both
    tokens; None when they agree on every id and every token both define."""
    for i in sorted(target.tokens.keys() & draft.tokens.keys()):
        if target.tokens[i] != draft.tokens[i]:
            return (
                f"id {i} is {target.tokens[i]!r} in the target and {draft.tokens[i]!r} in the draft"
            )
    target_ids = {t: i for i, t in target.tokens.items()}
    for i, t in sorted(draft.tokens.items()):
        if t in target_ids and target_ids[t] != i:
            return f"token {t!r} is id {target_ids[t]} in the target and id {i} in the draft"
    for role in SPECIAL_ROLES:
        a, b = target.special.get(role), draft.special.get(role)
        if a is not None and b is not None and a != b:
            return (
                f"the {role.upper()} token is id {a} ({target.tokens.get(a)!r}) in the target "
                f"and id {b} ({draft.tokens.get(b)!r}) in the draft"
            )
    return None


def require_compatible(
    target_path: str | os.PathLike[str], draft_path: str | os.PathLike[str], draft_rows: int
) -> None:
    """Refuse a draft whose vocabulary conflicts with the target's, naming the conflict, or
    whose embedding cannot read every token the target may emit (the draft reads the
    target's tokens: its `draft_rows`, config.json's `vocab_size`, must cover every id the
    target's tokenizer defines)."""
    target, draft = load_vocabulary(target_path), load_vocabulary(draft_path)
    if target.digest() != draft.digest():
        conflict = first_conflict(target, draft)
        if conflict is not None:
            raise ModelMismatchError(
                f"the draft's vocabulary ({draft_path}) conflicts with the target's "
                f"({target_path}): {conflict}; use a draft trained with the target's tokenizer"
            )
    needed = max(target.tokens) + 1
    if draft_rows < needed:
        raise ModelMismatchError(
            f"the draft ({draft_path}) embeds {draft_rows} token ids (config vocab_size) but the "
            f"target's tokenizer ({target_path}) defines ids up to {needed - 1}: the draft "
            "could not read the target's tokens; use a draft whose vocabulary covers the "
            "target's"
        )
