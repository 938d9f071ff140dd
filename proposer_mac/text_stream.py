"""Durable tokens to text deltas for clients that read text, not tokens (the OpenAI API).

Decoding the whole token list on every update means a delta never splits a UTF-8 character
or a BPE merge; tails that could begin a stop string wait for the next update; the first
stop string to complete cuts the text and ends the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("muser.http")


class TextStream:
    """Durable tokens in, text deltas out.

    Every feed decodes the whole token list, so a character or merge split across tokens
    comes out whole; a trailing partial character (U+FFFD) and any tail that could begin a
    stop string are held back until the next feed, and only text that extends what was
    already sent is emitted. The first stop string to complete cuts the text (after it with
    `include_stop`) and ends the stream. `skip_special`: special tokens (an end of sequence,
    a chat turn's markers) spell nothing.
    """

    def __init__(
        self,
        tokenizer,
        stops: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special: bool = True,
    ):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.include_stop, self.skip_special = include_stop, skip_special
        self.tokens: list[int] = []
        """Tokens the text covers: all fed, or those through the one completing a stop."""
        self.sent = ""
        self.stopped: str | None = None
        """The stop string that ended the text, once one has."""

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=self.skip_special)

    def feed(self, tokens: Sequence[int], *, final: bool = False) -> str:
        """Add durable tokens; return the text now safe to send (`final`: send the rest)."""
        before = len(self.tokens)
        self.tokens += tokens
        text = self.decode(self.tokens)
        cut = self._find_stop(text)
        if cut is not None:
            start, end = cut
            self.stopped = text[start:end]
            self.tokens = self.tokens[: self._tokens_through(text[:end], before)]
            return self._extend(text[: end if self.include_stop else start], last=True)
        if not final:
            text = text[: len(text) - self._holdback(text)]
        return self._extend(text, last=final)

    def _find_stop(self, text: str) -> tuple[int, int] | None:
        """The stop occurrence that completes first, not already inside the sent text:
        (start, end). Smallest end, then smallest start: what feeding one token at a time
        finds, however the tokens arrive (the stop that starts first may end later)."""
        longest = max((len(s) for s in self.stops), default=0)
        since = max(0, len(self.sent) - longest + 1)
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s, since)) >= 0]
        if not found:
            return None
        end, start = min(found)
        return start, end

    def _tokens_through(self, prefix: str, before: int) -> int:
        """The fewest tokens whose text covers `prefix` (the stop string's last token
        counts: it was generated for this request)."""
        for k in range(before + 1, len(self.tokens)):
            if self.decode(self.tokens[:k]).startswith(prefix):
                return k
        return len(self.tokens)

    def _holdback(self, text: str) -> int:
        """Characters at the end of `text` not yet safe to send."""
        whole = text.rstrip("\ufffd")
        partial = 0
        for stop in self.stops:
            partial = max([partial] + [k for k in range(1, len(stop)) if whole.endswith(stop[:k])])
        return len(text) - len(whole) + partial

    def _extend(self, text: str, *, last: bool) -> str:
        if not text.startswith(self.sent):  # an earlier character changed: wait for it to settle
            if last:
                log.warning("decoded text %r does not extend the text sent %r", text, self.sent)
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
