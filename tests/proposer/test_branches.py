"""Greedy branches (lane.speculate_branches): while a round is at the verifier, the proposer
drafts the next round on full acceptance and on the rejection of each of the first N drafts
(the draft's runner-up there as the target's pick), each on a clone of the session's draft
KV, all in one batched forward per step.

Drafter level, on the natural torch draft: each branch drafts what a plain draft after its
outcome drafts, on a clone that holds what that draft leaves; the drafter's own cursor does
not move; adopting a branch makes its clone the session's KV and drops the old one; an
outcome that is not drafted (past N, past max_tokens, a stop token) is not announced as a
guess; a stopped job drafts nothing. Daemon level, on fakes whose rows are exact: the
tokens are the local lane's, branches hit, the knob takes effect, no clone outlives its
session."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, argmax_lowest
from muser_app.lanes.local import run_local
from proposer_mac.drafting import Branch, Draft, Drafter
from tests.core.fake_backend import FakeBackend
from tests.proposer.test_draft_batch import assert_rows_close
from tests.proposer.test_generate_service import start, stop
from tests.verifier.conftest import PROMPT

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
STATE = Mt19937.from_seed(0)  # greedy drafting draws nothing


def branches(drafter, prompt, current, depths, stop_tokens=(), stop=None):
    guesses: list[list[int]] = []
    steps = drafter.branch_steps(
        prompt, current, depths, stop_tokens, stop or threading.Event(), guesses
    )
    return drafter.run(steps), guesses


def test_each_branch_drafts_what_a_plain_draft_after_its_outcome_drafts(natural):
    backend, prompts = natural
    for prompt in prompts:
        drafter = Drafter(backend.sequence(), GREEDY)
        current = drafter.draft(prompt, STATE, 4)
        held = list(drafter.cursor.tokens)
        assert held == [*prompt, *current.drafts[:-1]]
        # the runner-ups are the lone rows' second choices
        rows = backend.fork().evaluate([*prompt, *current.drafts[:-1]])[len(prompt) - 1 :]
        for k, row in enumerate(rows):
            assert argmax_lowest(row) == current.drafts[k]
            rest = row.copy()
            rest[current.drafts[k]] = -np.inf
            assert current.runners_up[k] == argmax_lowest(rest)
        got, guesses = branches(drafter, prompt, current, [3, 4, 2, 4, 4])
        assert drafter.cursor.tokens == held  # the session's own KV did not move
        assert all(isinstance(b, Branch) for b in got) and len(got) == 5
        expected = [[*current.drafts[:k], current.runners_up[k]] for k in range(4)]
        bonus = got[-1].speculation.emitted[-1]
        last = backend.fork().evaluate([*prompt, *current.drafts])[-1]
        assert bonus == argmax_lowest(last)  # the draft's own pick after every draft
        expected.append([*current.drafts, bonus])
        assert [b.speculation.emitted for b in got] == expected == guesses
        for b, depth in zip(got, [3, 4, 2, 4, 4], strict=True):
            spec = b.speculation
            plain = Drafter(backend.sequence(), GREEDY).draft(
                [*prompt, *spec.emitted], STATE, depth
            )
            assert spec.depth == depth and spec.proposal.drafts == plain.drafts
            assert_rows_close(spec.proposal.q_rows, plain.q_rows)
            assert b.cursor.tokens == [*prompt, *spec.emitted, *plain.drafts[:-1]]
            assert b.cursor.backend.length == len(b.cursor.tokens)
            assert b.cursor.holds(b.cursor.tokens)


def test_an_adopted_branch_is_the_sessions_kv_and_the_old_one_is_dropped(natural):
    backend, prompts = natural
    prompt = prompts[0]
    drafter = Drafter(backend.sequence(), GREEDY)
    current = drafter.draft(prompt, STATE, 4)
    old = drafter.cursor.backend
    got, _ = branches(drafter, prompt, current, [4] * 5)
    chosen = got[1]  # the first draft accepted, the second rejected for its runner-up
    assert chosen.cursor.backend._row is not None  # a row of the branches' group
    drafter.adopt_branch(chosen)
    assert drafter.cursor is chosen.cursor and old.length == 0
    assert chosen.cursor.backend._row is None  # it left the group: buffers of its own
    transcript = [*prompt, *chosen.speculation.emitted]
    assert drafter.draft(transcript, STATE, 4).drafts == chosen.speculation.proposal.drafts
    # and the round after it drafts as a drafter that never branched
    emitted = [*chosen.speculation.proposal.drafts[:2], 7]
    plain = Drafter(backend.sequence(), GREEDY).draft([*transcript, *emitted], STATE, 4)
    assert drafter.draft([*transcript, *emitted], STATE, 4).drafts == plain.drafts


def test_outcomes_not_drafted_are_not_guessed_and_a_stop_drafts_nothing(natural):
    backend, prompts = natural
    prompt = prompts[0]
    drafter = Drafter(backend.sequence(), GREEDY)
    current = drafter.draft(prompt, STATE, 4)
    picks = [t for t in range(100) if t not in current.drafts][:4]
    current = Draft(current.drafts, current.q_rows, picks)  # four distinct target picks
    # outcome 1 ends the session (None); outcome 2 emits a stop token; outcome 3 is drafted
    got, guesses = branches(drafter, prompt, current, [4, None, 4, 4, 4], (picks[2],))
    emitted = [b.speculation.emitted for b in got]
    bonus = emitted[-1][-1]
    assert (
        emitted
        == guesses
        == [
            [picks[0]],
            [*current.drafts[:3], picks[3]],
            [*current.drafts, bonus],
        ]
    )
    assert all(b.speculation.proposal is not None for b in got)
    halt = threading.Event()
    halt.set()
    got, _ = branches(drafter, prompt, current, [4] * 5, stop=halt)
    assert len(got) == 5 and all(b.speculation.proposal is None for b in got)


def test_once_a_branch_is_chosen_the_others_stop_and_it_finishes_alone(natural):
    backend, prompts = natural
    prompt = prompts[1]
    drafter = Drafter(backend.sequence(), GREEDY)
    current = drafter.draft(prompt, STATE, 4)
    chosen = [[*current.drafts[:1], current.runners_up[1]]]  # the decision: outcome 1
    steps = drafter.branch_steps(prompt, current, [4] * 5, (), threading.Event(), [], chosen)
    got = drafter.run(steps)
    done = [b.speculation for b in got if b.speculation.proposal is not None]
    assert [spec.emitted for spec in done] == chosen  # every other branch stopped
    plain = Drafter(backend.sequence(), GREEDY).draft([*prompt, *chosen[0]], STATE, 4)
    assert done[0].proposal.drafts == plain.drafts


def test_branches_need_greedy_and_a_sequence_that_clones(natural):
    backend, prompts = natural
    assert Drafter(backend.sequence(), GREEDY).can_branch
    assert not Drafter(backend.sequence(), SamplingParams(temperature=1.0)).can_branch
    assert not Drafter(backend.fork(), GREEDY).can_branch  # one KV: nothing to clone
    drafter = Drafter(backend.sequence(), GREEDY)
    current = drafter.draft(prompts[0], STATE, 4)
    drafter.cursor.truncate(len(prompts[0]))  # the cursor no longer stands where it drafted
    assert branches(drafter, prompts[0], current, [4] * 5) == ([], [])


# ---- the daemon ----------------------------------------------------------------------------


class SwappedDraft(FakeBackend):
    """The fake target's rows with the best two tokens swapped after every context whose sum
    is a multiple of 3: there the draft's pick is the target's second choice and its
    runner-up the target's pick, so a rejection there is a branch the draft guessed."""

    def __init__(self) -> None:
        super().__init__()  # the target's order and salt

    def _row(self, context: list[int]) -> np.ndarray:
        row = super()._row(context)
        if sum(context) % 3 == 0:
            first, second = np.argsort(-row, kind="stable")[:2]
            row[[first, second]] = row[[second, first]]
        return row


class CloningDraft(SwappedDraft):
    """`SwappedDraft` with per-sequence KV, batched evaluation and sequences that clone
    (exact rows: every draft equals the local lane's); `made` keeps every sequence made,
    clones included."""

    can_batch = True

    def __init__(self) -> None:
        super().__init__()
        self.made: list[FakeBackend] = []

    def sequence(self) -> FakeBackend:
        seq = SwappedDraft()
        seq.owner = self

        def clone() -> FakeBackend:
            twin = self.sequence()
            twin._tokens = list(seq._tokens)
            return twin

        seq.clone = clone
        self.made.append(seq)
        return seq

    def evaluate_batch(self, work):
        return [seq.evaluate(tokens) for seq, tokens in work]


async def greedy_session(key_set, tmp_path, branches: int | str):
    draft = CloningDraft()
    c = await start(key_set, tmp_path, draft=draft, lane={"speculate_branches": branches})
    try:
        runner = await c.server.core.start_session(PROMPT, GREEDY)
        await runner.task
    finally:
        await stop(c)
    return runner, draft


@pytest.mark.asyncio
async def test_greedy_branches_hit_and_never_change_the_tokens(key_set, tmp_path):
    local = run_local(FakeBackend(), SwappedDraft(), PROMPT, GREEDY)
    on, on_draft = await greedy_session(key_set, tmp_path / "on", 4)
    off, off_draft = await greedy_session(key_set, tmp_path / "off", 0)
    for runner in (on, off):
        assert runner.error is None and runner.session.emitted == local.tokens
    assert on.stats.branch_hits > 0 and off.stats.branch_hits == 0  # the knob takes effect
    # a branch that held is a next draft that did not wait for the decision
    assert on.stats.decisions_followed < off.stats.decisions_followed
    assert len(on_draft.made) > 1 and len(off_draft.made) == 1  # clones only with branches
    assert all(seq.length == 0 for seq in on_draft.made)  # no clone's KV outlives the session
    assert on.stats.to_dict()["speculation"]["branch_hits"] == on.stats.branch_hits


@pytest.mark.asyncio
async def test_auto_branches_are_two_and_none_for_a_draft_that_reads_capture_rows(
    key_set, tmp_path
):
    """lane.speculate_branches defaults to "auto": 2 branches (clones made, branches held)
    for a draft that reads no capture rows, none for one that does (the conditioned draft:
    its branches measured slower than none, docs/conditioned.md); a number is taken as is."""
    from types import SimpleNamespace

    from cluster_config.schema import Lane
    from proposer_mac.lane_setup import AUTO_BRANCHES, speculate_branches

    runner, draft = await greedy_session(key_set, tmp_path, "auto")
    local = run_local(FakeBackend(), SwappedDraft(), PROMPT, GREEDY)
    assert runner.error is None and runner.session.emitted == local.tokens
    assert runner.stats.branch_hits > 0 and len(draft.made) > 1
    assert Lane().speculate_branches == "auto"
    independent, conditioned = SimpleNamespace(), SimpleNamespace(capture_layers=(1, 3))
    assert speculate_branches(Lane(), independent) == AUTO_BRANCHES == 2
    assert speculate_branches(Lane(), conditioned) == 0
    for n in (0, 3):
        assert speculate_branches(Lane(speculate_branches=n), conditioned) == n
        assert speculate_branches(Lane(speculate_branches=n), independent) == n
    for bad in ("some", -1, 65):
        with pytest.raises(ValueError, match="speculate_branches"):
            Lane(speculate_branches=bad)


@pytest.mark.asyncio
async def test_branches_wait_for_an_idle_draft_thread(key_set, tmp_path, monkeypatch):
    """A branch job costs the draft thread more than one guess: with other jobs pending
    there (other sessions' drafts) a round speculates on full acceptance only."""
    from proposer_mac.draft_queue import DraftQueue

    monkeypatch.setattr(DraftQueue, "pending", property(lambda self: 1))
    runner, draft = await greedy_session(key_set, tmp_path, 4)
    local = run_local(FakeBackend(), SwappedDraft(), PROMPT, GREEDY)
    assert runner.error is None and runner.session.emitted == local.tokens
    assert runner.stats.speculated > 0 and runner.stats.branch_hits == 0
    assert len(draft.made) == 1  # no clone was made


def test_the_draft_queue_counts_jobs_until_their_results_are_out():
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from proposer_mac.draft_queue import DraftQueue

    async def scenario():
        pool = ThreadPoolExecutor(1)
        queue = DraftQueue(pool)
        gate = threading.Event()
        pool.submit(gate.wait, 10)  # the draft thread is busy
        drafter = Drafter(FakeBackend(), GREEDY)
        futures = [queue.draft(drafter, drafter.draft_steps(PROMPT, STATE, 2)) for _ in "ab"]
        counts = [queue.pending]
        gate.set()
        await asyncio.gather(*futures)
        counts.append(queue.pending)
        pool.shutdown()
        return counts

    assert asyncio.run(scenario()) == [2, 0]


def test_branches_draft_on_the_rows_of_one_group_where_the_sequence_makes_them(natural):
    """The branch job's clones are one group's consecutive rows (their batched forwards read
    the KV in place); a sequence without `clones` gets one clone each."""
    backend, prompts = natural
    drafter = Drafter(backend.sequence(), GREEDY)
    drafter.draft(prompts[0], STATE, 4)
    cursors = drafter._clones(3)
    rows = [c.backend._row for c in cursors]
    assert [r[1] for r in rows] == [0, 1, 2] and len({id(r[0]) for r in rows}) == 1
    assert all(c.tokens == drafter.cursor.tokens and c.holds(c.tokens) for c in cursors)
    assert drafter._clones(0) == []

    class OneByOne:  # the drafter's sequence, without `clones`
        def __init__(self, seq):
            self.seq, self.made = seq, 0

        def clone(self):
            self.made += 1
            return self.seq.clone()

    one = OneByOne(drafter.cursor.backend)
    drafter.cursor.backend = one
    assert len(drafter._clones(2)) == 2 and one.made == 2
