"""Drafting ahead (lane.speculate): while a round is at the verifier, the next one is drafted
on a guess of its outcome — full acceptance, or with greedy branches the rejection of each of
the first drafts too — and, once the verifier's early decision names the outcome, on that
decision. A draft made ahead is used only when the signed result emitted what it drafted
on; nothing is emitted on a guess (proposer_mac.driver's module note).

`DraftingAhead` is handed the session's start-draft callable (a draft made now, when no guess
held), so it needs nothing of the driver that runs it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from muser.errors import TreeTopologyError
from muser.mt19937 import Mt19937
from muser.records import advance, draws_for_round
from muser.round import clip_emission
from muser.stats import LaneStats
from muser.tasks import in_background
from muser.tree import check_path, tree_draws
from muser.wire import muser_v2_pb2 as pb
from proposer_mac.context import DriverContext
from proposer_mac.drafting import Branch, Draft, Drafter, first_branch
from proposer_mac.session import ProposerSession
from proposer_mac.speculating import Speculating, drop_clones, held_guess

log = logging.getLogger("muser.proposer")


def look_ahead(stream, spec: Speculating, round_: int) -> None:
    """Once `spec` has drafted round `round_`, name its guesses to the verifier (Lookahead
    hints, `Speculating.to_name`): it may evaluate the one that held before its request."""

    def send(future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            for guess in spec.to_name(future.result()[0]):
                if guess.proposal.parents:  # a tree's rows are no chain's: nothing to name
                    continue
                drafts = list(guess.proposal.drafts)
                in_background(
                    stream.look_ahead(round_, list(guess.emitted), drafts), "a lookahead", log
                )

    spec.future.add_done_callback(send)


@dataclass(frozen=True)
class Taken:
    """A draft made ahead, adopted (`DraftingAhead.take`)."""

    proposal: Draft
    waited: float
    """Seconds waited for it."""
    branch_hit: bool
    """A branch on a rejected draft drafted it."""
    guessed: bool
    """Drafted on a guess of the outcome, not on the verifier's decision."""


class DraftingAhead:
    """One session's drafts made ahead, in the draft thread (`core.drafts`)."""

    def __init__(
        self,
        session: ProposerSession,
        drafter: Drafter,
        core: DriverContext,
        stats: LaneStats,
        start_draft: Callable[[], Awaitable[tuple[Draft, float]]],
    ) -> None:
        self.session, self.drafter, self.core, self.stats = session, drafter, core, stats
        self.start_draft = start_draft
        """Draft the next round now, on where the session stands: (proposal, seconds)."""

    def start(
        self, proposal: Draft, after: tuple[list[int], int, Mt19937] | None = None
    ) -> Speculating | None:
        """Draft the round after this one, guessing it is fully accepted (see drafting.py),
        while this one is at the verifier; greedy with `branches`, on every outcome the
        draft can guess. None when this round ends the session anyway. `after`: this round
        was sent ahead, and the session will stand at (transcript, tokens emitted, MT
        state) when it starts (default: where the session stands)."""
        s = self.session
        transcript, produced, state = after or (s.transcript, len(s.emitted), s.state)
        remaining = s.params.max_tokens - produced - len(proposal.drafts) - 1
        if not self.core.speculate or not proposal.drafts:
            return None
        if proposal.parents:
            return self._tree(proposal, transcript, produced, state)
        if self.core.branches > 0 and self.drafter.can_branch and self.core.drafts.pending == 0:
            # branches cost the draft thread ~1.7x a guess: only when nothing else waits
            # for it (many sessions keep it busy; there a branch job delays their drafts)
            return self._branches(proposal, transcript, produced)
        if remaining < 1:
            return None
        depth = s.width.peek(len(proposal.drafts), remaining)
        stop, guess = threading.Event(), []
        steps = self.drafter.speculate_steps(
            list(transcript), state, proposal, depth, s.params.stop_tokens, stop, guess
        )
        future = self.core.drafts.draft(self.drafter, steps)
        return Speculating(future, stop, proposal.drafts, guess)

    def _tree(
        self, proposal: Draft, transcript: list[int], produced: int, state: Mt19937
    ) -> Speculating | None:
        """The next tree, on the guess that this one's first branch is accepted
        (`Drafter.speculate_tree_steps`), in the shape the session's tree policy picks now."""
        s = self.session
        path = [proposal.drafts[i] for i in first_branch(proposal.parents)]
        remaining = s.params.max_tokens - produced - len(path) - 1
        if s.tree is None or remaining < 1:
            return None
        stop, guess = threading.Event(), []
        steps = self.drafter.speculate_tree_steps(
            list(transcript), state, proposal, s.tree.choose(remaining), s.params.stop_tokens,
            stop, guess,
        )  # fmt: skip
        future = self.core.drafts.draft(self.drafter, steps)
        return Speculating(future, stop, path, guess)

    def _branches(
        self, proposal: Draft, transcript: list[int], produced: int
    ) -> Speculating | None:
        """Branches: the outcomes "rejected at draft k" for the first `core.branches` k,
        and full acceptance. Outcome k emits k + 1 tokens; one that reaches max_tokens ends
        the session, and one past the branches is left to the decision (None: not drafted)."""
        s, depth = self.session, len(proposal.drafts)
        left = s.params.max_tokens - produced
        depths = [
            s.width.peek(depth, left - k - 1, k)
            if left - k - 1 >= 1 and (k < self.core.branches or k == depth)
            else None
            for k in range(depth + 1)
        ]
        if all(d is None for d in depths):
            return None
        stop, guesses, chosen = threading.Event(), [], []
        steps = self.drafter.branch_steps(
            list(transcript), proposal, depths, s.params.stop_tokens, stop, guesses, chosen
        )
        future = self.core.drafts.draft(self.drafter, steps)
        return Speculating(future, stop, proposal.drafts, branches=guesses, chosen=chosen)

    def follow(
        self, spec: Speculating | None, current: Draft, d: pb.Decision
    ) -> Speculating | None:
        """The verifier decided the round in flight (`current`'s) and said how, before its
        commit and signed result: unless the speculation already drafts on that outcome, stop
        it and draft the next round on the decision now. A hint only decides when the next
        draft is made; the signed result decides whether it is used (`next_draft`)."""
        s = self.session
        depth = len(current.drafts)
        emitted = told_emission(current, d)
        if not self.core.speculate or depth == 0 or emitted is None:
            return spec
        if current.parents:
            return self._follow_tree(spec, current, d, emitted)
        if spec is not None and spec.drafts_on(emitted):
            spec.choose(emitted)
            return spec  # the guess was right (or this decision came before): keep drafting
        clip = clip_emission(emitted, len(s.emitted), s.params.max_tokens, s.params.stop_tokens)
        if clip.done:
            return spec  # the session ends with this round: nothing more to draft
        remaining = s.params.max_tokens - len(s.emitted) - len(clip.tokens)
        next_depth = s.width.peek(depth, remaining, d.accepted)
        draws = draws_for_round(depth, d.accepted, s.params.greedy, len(emitted))
        steps = self.drafter.follow_steps(
            list(s.transcript), current, emitted, advance(s.state, draws), next_depth
        )
        if spec is not None:
            spec.drop()
        self.stats.decisions_followed += 1
        future = self.core.drafts.draft(self.drafter, steps)
        return Speculating(future, threading.Event(), emitted[:-1], emitted, decided=True)

    def _follow_tree(
        self, spec: Speculating | None, current: Draft, d: pb.Decision, emitted: list[int]
    ) -> Speculating | None:
        """`follow` for a tree in flight: unless the guess (its first branch) drafts on what
        the decision says, the next tree is drafted on the decision now
        (`Drafter.follow_tree_steps`), in the shape the session's tree policy picks."""
        s = self.session
        if spec is not None and spec.drafts_on(emitted):
            spec.choose(emitted)
            return spec
        clip = clip_emission(emitted, len(s.emitted), s.params.max_tokens, s.params.stop_tokens)
        remaining = s.params.max_tokens - len(s.emitted) - len(clip.tokens)
        if clip.done or s.tree is None or remaining < 1:
            return spec
        post = advance(s.state, tree_draws(current.parents, list(d.path), s.params.greedy))
        stop = threading.Event()
        steps = self.drafter.follow_tree_steps(
            list(s.transcript), emitted, post, s.tree.choose(remaining), stop
        )
        if spec is not None:
            spec.drop()
        self.stats.decisions_followed += 1
        future = self.core.drafts.draft(self.drafter, steps)
        return Speculating(future, stop, emitted[:-1], emitted, decided=True)

    async def next_draft(
        self, speculation: Speculating | None, tokens: list[int]
    ) -> tuple[Draft, float]:
        """The next round's draft and the seconds it kept the round waiting after its result:
        the one drafted ahead (on a guess, or on the verifier's decision) when it drafted on
        what the round emitted, else a new one."""
        if speculation is not None:
            if not speculation.may_draft_on(tokens):
                speculation.stop.set()  # not what it drafted on: stop between two forwards
            elif speculation.drafts_on(tokens):
                speculation.choose(tokens)
            s = self.session  # (a tree's: any shape, its policy's when it was drafted)
            depth = None if s.tree else s.width.choose(s.params.max_tokens - len(s.emitted))
            taken = await self.take(speculation, tokens, depth)
            if taken is not None:
                self.hit(taken)
                return taken.proposal, taken.waited
        return await self.start_draft()

    def hit(self, taken: Taken) -> None:
        """A draft made ahead was used."""
        self.stats.speculation_hits += 1
        self.stats.branch_hits += taken.branch_hit
        self.stats.guess_hits += taken.guessed

    async def take(
        self, speculation: Speculating, tokens: list[int], depth: int | None, miss: bool = True
    ) -> Taken | None:
        """Wait for `speculation`'s job; when it drafted `depth` tokens (None: any number) on
        a round that emitted `tokens`, adopt that guess and return it (the caller counts the
        hit once the draft is used, `hit`). Otherwise None, its clones dropped (kept, with
        the job not counted, when `miss` is False: the caller gives the job to `next_draft`
        later)."""
        t0, ready = time.perf_counter(), speculation.future.done()
        spec, seconds = await speculation.future
        held = held_guess(spec, tokens, depth)
        if held is None and not miss:
            return None
        self.stats.speculation_s += seconds
        self.stats.speculated += 1
        drop_clones(spec, keep=held)  # the clones whose guesses failed
        if held is None:
            return None
        branch_hit = False
        if isinstance(held, Branch):
            self.drafter.adopt_branch(held)
            branch_hit = len(tokens) <= len(speculation.drafts)  # a draft was rejected
            held = held.speculation
        else:
            self.drafter.adopt()
        waited = 0.0 if ready else time.perf_counter() - t0
        return Taken(held.proposal, waited, branch_hit, guessed=not speculation.decided)


def told_emission(current: Draft, d: pb.Decision) -> list[int] | None:
    """What the round in flight (`current`) emits if its signed result says what the early
    decision `d` says: a chain's accepted drafts (or decoded tokens), a tree's accepted
    path, then the next frontier. None when `d` cannot be a decision of `current`."""
    if current.parents:
        path = [int(i) for i in d.path]
        if d.decoded or len(path) != d.accepted:
            return None
        try:
            check_path(current.parents, path)
        except TreeTopologyError:
            return None
        return [*(current.drafts[i] for i in path), int(d.next_frontier)]
    if d.path or d.accepted > len(current.drafts):
        return None
    return [*current.drafts[: d.accepted], *d.decoded, int(d.next_frontier)]
