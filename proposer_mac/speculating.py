"""What the round driver keeps of a round drafted ahead (`Speculating`): the draft thread's
job, the emissions it guesses, the one the verifier decided, and how a finished job's result
(one `Speculation`, or a list of `Branch`) is read: the guess that held, the clones to drop,
the guesses to name to the verifier."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from proposer_mac.drafting import Branch, Speculation


@dataclass(frozen=True)
class Speculating:
    """A speculative draft of the next round, running in the draft thread."""

    future: asyncio.Future
    stop: threading.Event
    drafts: list[int]
    """What the draft assumes the round in flight emits before its last token (its drafts,
    all accepted, for a guess; the decided tokens for a followed decision)."""
    emitted: list[int] = field(default_factory=list)
    """Everything it assumes the round emits; a guess fills it in the draft thread once its
    bonus token is picked (empty until then)."""
    branches: list[list[int]] = field(default_factory=list)
    """Branches (`Drafter.branch_steps`): every emission guessed so far, filled in the draft
    thread; its full-acceptance guess is the one `drafts` announces."""
    chosen: list[list[int]] = field(default_factory=list)
    """Branches: the emission the verifier decided, once known (the others then stop)."""
    told: list[int] = field(default_factory=list)
    """What the verifier decided the round in flight emits, once known (empty until then)."""
    decided: bool = False
    """Drafted on the verifier's early decision, not on a guess."""

    def choose(self, emitted: list[int]) -> None:
        """The round emits `emitted`, one of the branches: only that one goes on."""
        if self.branches and not self.chosen:
            self.chosen.append(list(emitted))  # read by the draft thread: one append

    def drafts_on(self, emitted: list[int]) -> bool:
        """Whether it drafts, or may yet draft, on a round that emits `emitted`."""
        return emitted == self.emitted or emitted in self.branches

    def may_draft_on(self, emitted: list[int]) -> bool:
        """`drafts_on`, or its full-acceptance guess is not yet known and may be this."""
        return emitted[:-1] == self.drafts or self.drafts_on(emitted)

    def to_name(self, result) -> list[Speculation]:
        """The guesses in this job's `result` that drafted a round to name to the verifier
        (Lookahead): every one while the decision is not known, the decided one after it."""
        return [
            guess
            for _, guess in _guesses(result)
            if guess.proposal.drafts and (not self.told or guess.emitted == self.told)
        ]

    def drop(self) -> None:
        """Its draft will not be used: stop it between two forwards, and once it ends drop
        the KV of any clones it drafted on (the draft thread no longer touches them)."""
        self.stop.set()
        self.future.add_done_callback(_release)


def _release(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        drop_clones(future.result()[0])


def held_guess(result, tokens: list[int], depth: int | None) -> Speculation | Branch | None:
    """The guess in a speculation job's result (one `Speculation`, or a list of `Branch`)
    that drafted `depth` tokens (None: any number) on a round that emitted `tokens`, if any."""
    for c, guess in _guesses(result):
        if guess.emitted == tokens and depth in (None, guess.depth):
            return c
    return None


def drop_clones(result, keep: Branch | None = None) -> None:
    """Drop the KV of the clones a branch job drafted on (a list of `Branch`), but `keep`'s;
    any other job's result drafted on the session's own sequence and has none."""
    for branch in result if isinstance(result, list) else []:
        if branch is not keep:
            branch.cursor.backend.reset()


def _guesses(result) -> Iterator[tuple[Speculation | Branch, Speculation]]:
    """(item, its speculation) for each guess in a job's result that drafted a round."""
    for c in result if isinstance(result, list) else [result]:
        guess = c.speculation if isinstance(c, Branch) else c
        if guess is not None and guess.proposal is not None:
            yield c, guess
