"""Drafting one round on the proposer (docs/design.md §2, draw order step 1), and drafting the
round after it before its result is known (latency hiding).

The drafter keeps its backend's KV equal to the transcript through a `KvCursor`; a round
samples D tokens from sparse top-k rows with one draw each from a copy of the pre-round MT
state, exactly what the verifier will replay.

Speculation: while round r is at the verifier, `speculate` drafts round r+1 on the guess
that r is fully accepted and that its bonus token is the one the draft itself would pick
with the same draw (the draw the verifier will use for the bonus is known: the stream is
replayable). The guess only decides *when* a draft is computed, never *what* it is: the
speculative draft runs the same cursor operations from the same checkpoint as a draft made
after the result, so on a hit it is the draft the local lane makes (bit for bit when it was
drafted alone; see batched drafting below), and on a miss the cursor is put back to the
checkpoint before drafting again. Exactness does not
depend on the guess.

Following a decision: the verifier tells the round's outcome as soon as it is decided, before
its commit and its signed result (an unsigned hint). When the speculation guessed otherwise,
`follow_steps` drafts the next round on that outcome at once: again the post-result draft,
made earlier; the signed result still decides whether it is used.

Branches (greedy): rather than one guess, `branch_steps` drafts the next round on full
acceptance and on the rejection of each of the first N drafts, the target's pick there
guessed to be the draft's runner-up (`Draft.runners_up`), each on a clone of the session's
draft sequence, all in one batched forward per step. The drafter's own cursor does not
move; the branch whose guess the result confirms is adopted (its clone becomes the session's
sequence), the other clones are dropped. A batched row may differ from a lone one in its
last bits, which can move a draft but never a greedy token (each is the target's pick).

Batched drafting: a draft and a speculation are written as *steps*, generators that yield
the tokens whose rows they need next and receive those rows. `Drafter.draft` feeds one from
its own cursor (`KvCursor.extend`); `run_together` feeds the steps of several sessions,
each on its own sequence of one `MultiSequenceBackend`, from one batched forward per step,
so rounds waiting together cost one forward per draft token instead of one per session.
The draws are the same either way (one per draft row, in order, from the round's own copy
of the pre-round state); a batched row may differ from the lone one in its last float bits,
which moves no distribution: the request carries the q rows the drafts were sampled from,
and the verifier judges against those.

Trees (lane.tree_nodes, docs/design.md §3): `tree_steps` drafts a token tree into a given
shape (a template, `muser.tree_width`; `muser.tree.draft_tree`: breadth first, one tree
forward a depth on the session's own sequence of a torch draft, children drawn without
replacement). Its forwards run inside the job, never as steps (a tree block has a mask of
its own, so it does not batch with other sessions' steps). While a tree is at the verifier,
`speculate_tree_steps` drafts the next one on the guess that its first branch is accepted
down to a leaf (the chain's guess, along that branch); when the verifier's early decision
says otherwise, `follow_tree_steps` drafts the next tree on the decision.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from muser.backend import ModelBackend, MultiSequenceBackend, batches, tree_evaluator
from muser.cursor import KvCursor, set_owner
from muser.errors import RefusedError
from muser.mt19937 import Mt19937
from muser.records import advance, draws_for_round
from muser.round import DEFAULT_Q_TOP_K
from muser.sampling import SamplingParams, SparseRow, argmax_lowest, draft_row, sample_ordered
from muser.tree import draft_tree, per_path, tree_draws
from muser.tree_width import most_children
from proposer_mac.backends.ngram import no_proposal


@dataclass(frozen=True)
class Draft:
    drafts: list[int]
    q_rows: list[SparseRow]
    runners_up: list[int] = field(default_factory=list)
    """Greedy: at each draft position, the draft's best token after the draft itself, its
    guess at what the target picks there when it rejects the draft (empty when sampling)."""
    parents: list[int] = field(default_factory=list)
    """A tree round's topology (`muser.tree.Tree.parents`; `drafts` are its nodes' tokens,
    `q_rows` its `wire_rows`); empty for a chain."""


@dataclass(frozen=True)
class Speculation:
    """Round r+1 drafted on a guess about round r's outcome."""

    emitted: list[int]
    """What round r is guessed to emit: its drafts, all accepted, then the bonus guess."""
    depth: int | None
    """The D it drafted (None: a tree, in whatever shape its policy chose)."""
    proposal: Draft | None
    """None when the speculation was stopped or the guess ends the session."""


@dataclass(frozen=True)
class Branch:
    """One guessed outcome of the round in flight, drafted on its own clone of the draft KV
    (`Drafter.branch_steps`); adopting it makes that clone the drafter's cursor."""

    speculation: Speculation
    cursor: KvCursor


T = TypeVar("T")
Steps = Generator[list[int], np.ndarray, T]
"""Drafting as steps: yields the tokens to evaluate after the cursor's cache, is sent their
rows (len(tokens), V), and returns its result. Whoever drives it evaluates the tokens on the
drafter's cursor (and records them there), so the cursor always holds what was evaluated."""


class Stopped(Exception):
    """A speculation was told to stop between two forwards."""


@dataclass
class _Checkpoint:
    """Where the last real draft left the cursor: its tokens and the row after them."""

    tokens: list[int]
    last_row: np.ndarray | None


class Drafter:
    def __init__(
        self, backend: ModelBackend, params: SamplingParams, q_top_k: int = DEFAULT_Q_TOP_K
    ) -> None:
        self.cursor = KvCursor(backend)
        self.params = params
        self.q_top_k = q_top_k
        self._checkpoint: _Checkpoint | None = None
        """Where the cursor stood after the last non-speculative draft, while a speculation
        may have moved it."""
        self._can_branch: bool | None = None  # `can_branch`, once asked

    def install_features(self, first: int, rows) -> None:
        """Hand a conditioned draft (`proposer_mac.backends.conditioned`) the target's capture
        rows from position `first`. The cursor claims its backend first: a claim resets the
        KV, rows and all, so one made at the next draft would drop them. Rows that do not
        continue what the draft holds (a restarted draft holds none) are left: the verifier's
        first round after an open sends them from position 0 again."""
        backend = self.cursor.backend
        self.cursor.claim()
        if first <= backend.features_known:
            backend.install_features(first, rows)

    def draft(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        depth: int,
        stop: threading.Event | None = None,
    ) -> Draft:
        """Draft `depth` tokens after `transcript` (which ends with the frontier)."""
        return self.run(self.draft_steps(transcript, state, depth, stop))

    def run(self, steps: Steps[T]) -> T:
        """Drive `steps` alone, each step's rows from this drafter's own cursor."""
        try:
            tokens = next(steps)
            while True:
                tokens = steps.send(self.cursor.extend(tokens))
        except StopIteration as done:
            return done.value

    def draft_steps(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        depth: int,
        stop: threading.Event | None = None,
    ) -> Steps[Draft]:
        """`draft` as steps."""
        self._restore()
        return (yield from self._draft(transcript, state, depth, stop))

    def _draft(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        depth: int,
        stop: threading.Event | _Unchosen | None,
        cursor: KvCursor | None = None,
    ) -> Steps[Draft]:
        """Draft on `cursor` (default: the drafter's own; a branch drafts on its clone)."""
        if depth == 0:
            return Draft([], [])
        if stop is not None and stop.is_set():  # stopped before it began (D = 1 checks only here)
            raise Stopped
        cursor = cursor or self.cursor
        if not getattr(cursor.backend, "ready", True):  # a conditioned draft before any rows
            return Draft([], [])
        rng = state.copy()
        todo = cursor.prepare(transcript)
        row = (yield todo)[-1] if todo else cursor.last_row
        drafts: list[int] = []
        q_rows: list[SparseRow] = []
        runners_up: list[int] = []
        for i in range(depth):
            if no_proposal(row):  # a draft may decline (the n-gram draft finds no match)
                break
            q = draft_row(row, self.params, self.q_top_k)
            if self.params.greedy:
                token = int(q.ids[argmax_lowest(q.weights)])
                runners_up.append(runner_up(row, token))
            else:
                token = int(q.ids[sample_ordered(q.weights, rng.uniform_f64())])
            drafts.append(token)
            q_rows.append(q)
            if i + 1 < depth:
                if stop is not None and stop.is_set():
                    raise Stopped
                row = (yield [token])[-1]
        return Draft(drafts, q_rows, runners_up)

    def tree_steps(
        self, transcript: Sequence[int], state: Mt19937, template: Sequence[int]
    ) -> Steps[Draft]:
        """A tree drafted into `template` (a shape, `muser.tree_width`) after `transcript`
        (which ends with the frontier), as steps that yield nothing: its forwards run here
        (module note). The draft's sequence is left holding the
        transcript, frontier included, with the frontier's row (the next round's draft
        evaluates what it emits after that)."""
        self._restore()
        return self._tree(transcript, state, template)
        yield  # (a generator: the draft thread drives it like any draft)

    def speculate_tree_steps(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        current: Draft,
        template: Sequence[int],
        stop_tokens: Sequence[int],
        stop: threading.Event | None = None,
        guess: list[int] | None = None,
    ) -> Steps[Speculation | None]:
        """The tree after the tree `current` (just drafted from `transcript`, `state`), on the
        guess that the judge takes the first child at every depth, down to a leaf, and that
        the next frontier is the draft's own pick there with the verifier's draw for it (the
        chain's guess, `speculate_steps`, along the tree's first branch); drafted into
        `template`. `guess` is given the guessed emission once known. None when the cursor no longer
        stands where `current` left it or the draft makes no guess."""
        parents = list(current.parents)
        held = list(transcript)
        if not parents or not self.cursor.holds(held) or self.cursor.last_row is None:
            return None
        path = first_branch(parents)
        self._checkpoint = _Checkpoint(held, self.cursor.last_row)
        row = (yield [current.drafts[i] for i in path])[-1]  # the leaf's row
        if no_proposal(row):
            return None
        q = draft_row(row, self.params, self.q_top_k)
        draws = tree_draws(parents, path, self.params.greedy)
        if self.params.greedy:
            bonus = int(q.ids[argmax_lowest(q.weights)])
        else:  # the round's last draw samples its next frontier
            bonus = int(q.ids[sample_ordered(q.weights, advance(state, draws - 1).uniform_f64())])
        emitted = [*(current.drafts[i] for i in path), bonus]
        if guess is not None:
            guess[:] = emitted  # read by the event loop's thread: one slice store
        if any(t in stop_tokens for t in emitted) or not template:
            return Speculation(emitted, None, None)
        try:
            proposal = self._tree([*transcript, *emitted], advance(state, draws), template, stop)
        except Stopped:
            return Speculation(emitted, None, None)
        return Speculation(emitted, None, proposal)

    def _tree(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        template: Sequence[int],
        stop: threading.Event | None = None,
    ):
        cursor = self.cursor
        seq = cursor.backend
        owner = tree_evaluator(seq)
        if hasattr(seq, "candidates"):  # prompt lookup: rows from the tokens alone
            return self._lookup_tree(transcript, state, template)
        if not hasattr(owner, "evaluate_tree"):
            raise RefusedError(
                f"a tree round needs a draft that evaluates token trees on a sequence of its "
                f"own (a torch or conditioned draft) or prompt lookup; {type(seq).__name__} is "
                "neither (set lane.tree_nodes = 0)"
            )
        if not template or not getattr(seq, "ready", True):  # (a conditioned draft's rows)
            return Draft([], [])
        frontier, greedy = int(transcript[-1]), self.params.greedy
        # greedy children are the row's largest weights: rows at T = 1, as wide as the most
        # children any position gets (the verifier replays the same top-k of the same row)
        params = dataclasses.replace(self.params, temperature=1.0) if greedy else self.params
        width = most_children(template) if greedy else self.q_top_k
        cursor.hold(list(transcript[:-1]))
        root: list[np.ndarray] = []

        def rows_at(parents: list[int], tokens: list[int], positions: list[int]):
            if stop is not None and stop.is_set():  # a speculation stopped between forwards
                raise Stopped
            logits = owner.evaluate_tree(seq, [frontier, *tokens], parents)
            root[:] = [logits[0]]
            return [draft_row(logits[v], params, width) for v in positions]

        tree = draft_tree(state.copy(), template, rows_at, greedy)
        seq.keep_path([])  # the frontier's KV kept, the nodes' dropped
        cursor.record([frontier], np.asarray(root))
        return Draft(list(tree.tokens), list(tree.wire_rows()), parents=list(tree.parents))

    def follow_tree_steps(
        self,
        transcript: Sequence[int],
        emitted: Sequence[int],
        post: Mt19937,
        template: Sequence[int],
        stop: threading.Event | None = None,
    ) -> Steps[Speculation]:
        """The tree after the tree in flight (drafted from `transcript`), drafted on the
        verifier's early decision before the signed result: after `transcript + emitted`
        from `post`, into `template` (its forwards run here, as `tree_steps`'); the very tree
        `tree_steps` drafts there once the result says the same."""
        self._rewind()
        proposal = self._tree([*transcript, *emitted], post, template, stop)
        return Speculation(list(emitted), None, proposal)
        yield  # (a generator: the draft thread drives it like any draft)

    def _lookup_tree(self, transcript: Sequence[int], state: Mt19937, template: Sequence[int]):
        """`_tree` for the n-gram draft: each position's row is `NgramDraft.candidates` after
        its path; the cursor is left holding the transcript, its last row the frontier's."""
        if not template:
            return Draft([], [])
        self.cursor.sync(list(transcript))
        rows_at = per_path(self.cursor.backend.candidates)
        tree = draft_tree(state.copy(), template, rows_at, self.params.greedy)
        return Draft(list(tree.tokens), list(tree.wire_rows()), parents=list(tree.parents))

    def speculate(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        current: Draft,
        next_depth: int,
        stop_tokens: Sequence[int],
        stop: threading.Event | None = None,
    ) -> Speculation | None:
        """Draft the round after `current` (just drafted from `transcript`, `state`) on the
        guess that it is fully accepted. Call right after `draft` returned `current`; None
        when the cursor no longer stands where that draft left it (another session drafted
        in between) or the round drafts nothing."""
        return self.run(
            self.speculate_steps(transcript, state, current, next_depth, stop_tokens, stop)
        )

    def speculate_steps(
        self,
        transcript: Sequence[int],
        state: Mt19937,
        current: Draft,
        next_depth: int,
        stop_tokens: Sequence[int],
        stop: threading.Event | None = None,
        guess: list[int] | None = None,
    ) -> Steps[Speculation | None]:
        """`speculate` as steps; `guess` is given the guessed emission as soon as it is
        known (before the next round is drafted on it)."""
        depth = len(current.drafts)
        held = [*transcript, *current.drafts[:-1]]
        if depth == 0 or not self.cursor.holds(held) or self.cursor.last_row is None:
            return None
        self._checkpoint = _Checkpoint(held, self.cursor.last_row)
        row = (yield [current.drafts[-1]])[-1]
        if no_proposal(row):  # no guess at the bonus: wait for the result
            return None
        q = draft_row(row, self.params, self.q_top_k)
        if self.params.greedy:
            bonus = int(q.ids[argmax_lowest(q.weights)])
        else:
            u = advance(state, 2 * depth).uniform_f64()  # the verifier's bonus draw
            bonus = int(q.ids[sample_ordered(q.weights, u)])
        emitted = [*current.drafts, bonus]
        if guess is not None:
            guess[:] = emitted  # read by the event loop's thread: one slice store
        if any(t in stop_tokens for t in emitted):
            return Speculation(emitted, next_depth, None)
        post = advance(state, draws_for_round(depth, depth, self.params.greedy))
        self._rewind()  # the draft below must start where a post-result draft starts
        steps = self._draft([*transcript, *emitted], post, next_depth, stop)
        return (yield from _speculation(emitted, next_depth, steps))

    def follow_steps(
        self,
        transcript: Sequence[int],
        current: Draft,
        emitted: Sequence[int],
        post: Mt19937,
        depth: int,
    ) -> Steps[Speculation]:
        """The round after `current` (drafted from `transcript`), drafted on the verifier's
        early decision before the signed result: after `transcript + emitted` from `post`,
        from where the post-result draft starts (the cursor goes back to `current`'s
        checkpoint first, and keeps it: if the result says otherwise, the draft made then
        starts there too, as after a missed guess)."""
        if self._checkpoint is None:  # no speculation since `current`: mark where it ended
            held = [*transcript, *current.drafts[:-1]]
            if current.drafts and self.cursor.holds(held) and self.cursor.last_row is not None:
                self._checkpoint = _Checkpoint(held, self.cursor.last_row)
        self._rewind()
        proposal = yield from self._draft([*transcript, *emitted], post, depth, None)
        return Speculation(list(emitted), depth, proposal)

    @property
    def can_branch(self) -> bool:
        """Whether `branch_steps` can run here: greedy drafts on a sequence that clones.
        Asked every round, answered once: the params are fixed, and an adopted branch's
        sequence is a clone over the same weights (`batches` checks a runtime protocol,
        ~0.1 ms a call)."""
        if self._can_branch is None:
            backend = self.cursor.backend
            self._can_branch = bool(
                self.params.greedy
                and callable(getattr(backend, "clone", None))
                and batches(getattr(backend, "owner", None))
            )
        return self._can_branch

    def branch_steps(
        self,
        transcript: Sequence[int],
        current: Draft,
        depths: Sequence[int | None],
        stop_tokens: Sequence[int],
        stop: threading.Event,
        guesses: list[list[int]],
        chosen: list[list[int]] | None = None,
    ) -> Steps[list[Branch]]:
        """Greedy: draft the round after `current` on every outcome the draft can guess at
        once, while `current` is at the verifier. Rejected at draft k (k < D), the target
        emits drafts[:k] then its own pick, guessed to be the draft's runner-up there; fully
        accepted, it emits every draft then the bonus, guessed to be the draft's own pick.
        `depths[k]` is the next round's D after outcome k (None: the session ends there).

        Each guess drafts on a clone of the draft KV, all of them in one batched forward
        per step (`run_together`); the drafter's own cursor does not move, so a miss drafts
        from there as before. `guesses` is given each guessed emission as soon as it is known
        (before it is drafted on). Once an emission is put in `chosen` (the verifier decided
        it), every other branch stops between two forwards and the chosen one finishes alone.
        The forwards run here, not in the queue's driver: the steps ask it for none. Greedy
        drafts do not depend on the MT state (no draws)."""
        chosen = [] if chosen is None else chosen
        return self._branch(transcript, current, depths, stop_tokens, stop, guesses, chosen)
        yield  # a generator: the draft thread's queue runs it like any other job

    def _branch(
        self, transcript, current, depths, stop_tokens, stop, guesses, chosen
    ) -> list[Branch]:
        depth = len(current.drafts)
        held = [*transcript, *current.drafts[:-1]]
        if (
            depth == 0
            or len(current.runners_up) != depth
            or len(depths) != depth + 1
            or not self.cursor.holds(held)
            or self.cursor.last_row is None
        ):
            return []
        none = _no_draws()  # greedy drafting draws nothing
        rejected = [
            (k, [*current.drafts[:k], current.runners_up[k]])
            for k in range(depth)
            if depths[k] is not None
        ]
        rejected = [(k, e) for k, e in rejected if not any(t in stop_tokens for t in e)]
        cursors = self._clones(len(rejected) + (depths[depth] is not None))
        work: list[tuple[KvCursor, Steps]] = []
        for (k, emitted), cursor in zip(rejected, cursors[: len(rejected)], strict=True):
            guesses.append(emitted)  # read by the event loop's thread: one append
            halt = _Unchosen(stop, chosen, emitted)
            steps = self._draft([*transcript, *emitted], none, depths[k], halt, cursor)
            work.append((cursor, _speculation(emitted, depths[k], steps)))
        if depths[depth] is not None:
            cursor = cursors[-1]
            work.append((cursor, self._accepted_branch(
                transcript, current, cursor, depths[depth], stop_tokens, stop, guesses, chosen
            )))  # fmt: skip
        results = run_together(self.cursor.backend.owner, work)
        return [
            Branch(spec, cursor)
            for (cursor, _), spec in zip(work, results, strict=True)
            if isinstance(spec, Speculation)
        ]

    def _accepted_branch(
        self, transcript, current, cursor, depth, stop_tokens, stop, guesses, chosen
    ) -> Steps[Speculation]:
        """The full-acceptance guess on `cursor`: the bonus is the draft's own pick."""
        row = (yield [current.drafts[-1]])[-1]
        emitted = [*current.drafts, argmax_lowest(row)]
        guesses.append(emitted)  # read by the event loop's thread: one append
        if any(t in stop_tokens for t in emitted):
            return Speculation(emitted, depth, None)
        halt = _Unchosen(stop, chosen, emitted)
        steps = self._draft([*transcript, *emitted], _no_draws(), depth, halt, cursor)
        return (yield from _speculation(emitted, depth, steps))

    def _clones(self, n: int) -> list[KvCursor]:
        """`n` cursors on clones of this drafter's sequence, each holding what it holds: the
        rows of one group where the sequence makes them (`TorchSequence.clones`: the batched
        forwards of `run_together` then read their KV in place), else one clone each."""
        if n == 0:
            return []
        backend = self.cursor.backend
        many = getattr(backend, "clones", None)
        seqs = many(n) if callable(many) else [backend.clone() for _ in range(n)]
        cursors = []
        for seq in seqs:
            cursor = KvCursor(seq)
            cursor.tokens, cursor.last_row = list(self.cursor.tokens), self.cursor.last_row
            set_owner(seq, cursor)
            cursors.append(cursor)
        return cursors

    def adopt_branch(self, branch: Branch) -> None:
        """`branch`'s guess held: its clone becomes this drafter's sequence (the old one's KV
        is dropped), standing where the post-result draft would have left it."""
        old, self.cursor = self.cursor.backend, branch.cursor
        old.reset()
        leave = getattr(branch.cursor.backend, "leave_group", None)
        if callable(leave):  # its group's other rows are dropped: keep only its own KV
            leave()
        self._checkpoint = None

    def adopt(self) -> None:
        """The guess held: the cursor already stands where the post-result draft left it."""
        self._checkpoint = None

    def _rewind(self) -> None:
        """Back to the checkpoint, if the cursor still holds its tokens. Matched on the
        tokens, not the length: a draft on a decision that rejected a draft holds another
        prefix of that length, and the checkpoint's row is not the row after it."""
        cp = self._checkpoint
        n = len(cp.tokens) if cp is not None else 0
        if cp is None or len(self.cursor.tokens) < n:
            return
        if self.cursor.tokens[:n] != cp.tokens:
            self._checkpoint = None  # stale: the cursor's own row stands
            return
        self.cursor.truncate(n)
        self.cursor.last_row = cp.last_row

    def _restore(self) -> None:
        """Put the cursor back where the last real draft left it (after a missed guess)."""
        self._rewind()
        self._checkpoint = None


def run_together(
    backend: MultiSequenceBackend, work: Sequence[tuple[KvCursor, Steps]]
) -> list[object]:
    """Drive every `(cursor, steps)` of `work` in lockstep: each round of steps gets its
    rows from one `backend.evaluate_batch` over the cursors' sequences (ragged: each asks
    for its own tokens after its own KV). Returns each steps' result, or the exception that
    ended it; one failing never stops or corrupts the others."""
    out: list[object] = [None] * len(work)
    asks: dict[int, list[int]] = {}

    def step(i: int, rows: np.ndarray | BaseException | None) -> None:
        steps = work[i][1]
        try:
            if rows is None:
                asks[i] = next(steps)
            elif isinstance(rows, BaseException):
                asks[i] = steps.throw(rows)  # raised where the lone run's extend would raise
            else:
                asks[i] = steps.send(rows)
        except StopIteration as done:
            out[i] = done.value
            asks.pop(i, None)
        except Exception as exc:  # this session's failure is its own: reported, not spread
            out[i] = exc
            asks.pop(i, None)

    for i in range(len(work)):
        step(i, None)
    while asks:
        rows = _evaluate_together(backend, {i: (work[i][0], asks[i]) for i in asks})
        for i, got in rows.items():
            step(i, got)
    return out


def _evaluate_together(
    backend: MultiSequenceBackend, asks: dict[int, tuple[KvCursor, list[int]]]
) -> dict[int, np.ndarray | Exception]:
    """One forward for every cursor's tokens, recorded on each cursor. A forward refused for
    one sequence (its context is full) is refused for all: then each is evaluated alone, so
    only the one at fault fails."""
    work = [(cursor.backend, tokens) for cursor, tokens in asks.values()]
    try:
        rows = backend.evaluate_batch(work)
    except Exception:
        out: dict[int, np.ndarray | Exception] = {}
        for i, (cursor, tokens) in asks.items():
            cursor.realign()  # a sequence may keep what the failed forward appended
            try:
                out[i] = cursor.extend(tokens)
            except Exception as exc:
                out[i] = exc
        return out
    for (cursor, tokens), got in zip(asks.values(), rows, strict=True):
        cursor.record(tokens, got)
    return dict(zip(asks, rows, strict=True))


class _Unchosen:
    """A branch's stop: its job was stopped, or another branch was chosen."""

    def __init__(self, stop: threading.Event, chosen: list[list[int]], emitted: list[int]):
        self.stop, self.chosen, self.emitted = stop, chosen, emitted

    def is_set(self) -> bool:
        return self.stop.is_set() or (bool(self.chosen) and self.chosen[0] != self.emitted)


def first_branch(parents: Sequence[int]) -> list[int]:
    """The nodes of a tree's first branch: the root's first child, its first child, and so
    on down to a leaf (what a tree speculation guesses the judge accepts)."""
    path, above = [], -1
    while (child := next((i for i, p in enumerate(parents) if p == above), None)) is not None:
        path.append(child)
        above = child
    return path


@functools.cache
def _no_draws() -> Mt19937:
    """A state for drafts that draw nothing (greedy), made once: seeding one runs the
    reference initialisation in Python, a few hundred microseconds each round otherwise.
    Every draft drafts from a copy (`_draft`), so the one state is never advanced."""
    return Mt19937.from_seed(0)


def runner_up(row: np.ndarray, token: int) -> int:
    """The best id of `row` other than `token` (the lowest on ties, as `argmax_lowest`)."""
    rest = np.array(row, dtype=np.float64)
    rest[token] = -np.inf
    return argmax_lowest(rest)


def _speculation(emitted: list[int], depth: int, steps: Steps[Draft]) -> Steps[Speculation]:
    """`steps`' draft as the speculation on `emitted`; stopped, it drafted nothing."""
    try:
        proposal = yield from steps
    except Stopped:
        return Speculation(emitted, depth, None)
    return Speculation(emitted, depth, proposal)
