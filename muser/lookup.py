"""Prompt lookup over one sequence's tokens: the n-gram index the model-free draft proposes
from (`proposer_mac.backends.ngram`) and the verifier stops a decode round on
(`verifier_gx.decode`, a round's `lookup`), so both sides ask the very same question.

After each token, the lookup looks for an earlier occurrence of the sequence's last n tokens,
for n from `max_n` down to `min_n`, and proposes the token that followed the most recent such
occurrence (vLLM's `ngram` proposer, llama.cpp's lookup decoding and transformers'
`prompt_lookup_num_tokens` do the same). Pushing and popping a token costs O(max_n).
"""

from __future__ import annotations

from collections.abc import Iterable

from muser.errors import InvalidOverrideError

LOOKUP_MAX_N = 16
"""The longest n-gram a lookup may match (a bound on a request's cost to the verifier)."""


def check_lookup_n(min_n: object, max_n: object, what: str = "ngram") -> tuple[int, int]:
    """(min_n, max_n) when both are ints in [1, LOOKUP_MAX_N] with min_n ≤ max_n; else
    InvalidOverrideError naming what was received."""
    for name, value in (("min_n", min_n), ("max_n", max_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidOverrideError(f"{what} {name} {value!r} is invalid: expected int ≥ 1")
        if value > LOOKUP_MAX_N:
            raise InvalidOverrideError(
                f"{what} {name} {value} is invalid: expected at most {LOOKUP_MAX_N}"
            )
    if min_n > max_n:  # type: ignore[operator]
        raise InvalidOverrideError(f"{what} min_n {min_n} exceeds max_n {max_n}")
    return int(min_n), int(max_n)  # type: ignore[call-overload]


class PromptLookup:
    """The n-gram index of one token sequence, grown and shrunk at its end."""

    def __init__(self, min_n: int, max_n: int, tokens: Iterable[int] = ()) -> None:
        self.min_n, self.max_n = check_lookup_n(min_n, max_n)
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]
        """ends[n][gram]: the lengths of the prefixes that end with `gram`, ascending."""
        for token in tokens:
            self.push(int(token))

    def __len__(self) -> int:
        return len(self.tokens)

    def proposal(self) -> int | None:
        """The token after the most recent earlier occurrence of the longest matching suffix
        (n from max_n down to min_n); None when no suffix occurred before."""
        seq, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            ends = self.ends[n].get(tuple(seq[length - n :]))
            if ends is not None and len(ends) >= 2:  # ends[-1] is the suffix itself
                return seq[ends[-2]]
        return None

    def push(self, token: int) -> None:
        self.tokens.append(token)
        length = len(self.tokens)
        for n in range(1, min(self.max_n, length) + 1):
            self.ends[n].setdefault(tuple(self.tokens[length - n :]), []).append(length)

    def pop(self) -> None:
        length = len(self.tokens)
        for n in range(1, min(self.max_n, length) + 1):
            gram = tuple(self.tokens[length - n :])
            ends = self.ends[n][gram]
            ends.pop()  # always the last: prefixes are pushed and popped in order
            if not ends:
                del self.ends[n][gram]
        self.tokens.pop()
