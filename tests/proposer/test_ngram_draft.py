"""The model-free n-gram draft (proposer_mac/backends/ngram.py): its proposals against a slow
reference, rollback, identity, its knobs, q one-hot at every temperature, and a draft that
ends early when nothing matches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muser.backend import Geometry, ModelIdentity
from muser.errors import ContextOverflowError, InvalidOverrideError, RollbackError
from muser.identity import require_shared_vocabulary
from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, draft_row
from muser.tree_width import full_parents
from proposer_mac.backends.ngram import NgramDraft, no_proposal
from proposer_mac.drafting import Drafter

VOCAB = 16
TARGET = ModelIdentity("target-digest", "tok-digest", VOCAB, "LlamaForCausalLM", "/t")


def ngram(min_n: int = 1, max_n: int = 3, context: int = 4096) -> NgramDraft:
    return NgramDraft.over(TARGET, Geometry(context, 1, 8, None, None), min_n, max_n)


def reference(seq: list[int], min_n: int, max_n: int) -> int | None:
    """The proposal after `seq`, the slow way: the longest suffix (max_n down to min_n) that
    occurred earlier, and the token after its most recent earlier occurrence."""
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        gram = seq[len(seq) - n :]
        for end in range(len(seq) - 1, n - 1, -1):  # prefixes seq[:end] ending with gram
            if seq[end - n : end] == gram:
                return seq[end]
    return None


def proposals(rows: np.ndarray) -> list[int | None]:
    return [None if no_proposal(r) else int(np.argmax(r)) for r in rows]


def test_rows_are_one_hot_logits_at_the_token_after_the_earlier_match() -> None:
    draft = ngram()
    rows = draft.evaluate([5, 6, 7, 8, 5, 6])
    assert proposals(rows) == [None, None, None, None, 6, 7]
    assert rows[5, 7] == 0.0 and np.isneginf(np.delete(rows[5], 7)).all()
    assert no_proposal(rows[0]) and draft.length == 6


def test_the_longest_match_wins_then_the_most_recent() -> None:
    # (1, 2) occurred before, followed by 9; the 1-gram (2,) last occurred before 8
    assert proposals(ngram().evaluate([1, 2, 9, 7, 2, 8, 1, 2]))[-1] == 9
    assert proposals(ngram(max_n=1).evaluate([1, 2, 9, 7, 2, 8, 1, 2]))[-1] == 8
    # the 1-gram (1,) occurred after 0 and after 2: the most recent (3) is proposed
    assert proposals(ngram().evaluate([1, 0, 1, 3, 1]))[-1] == 3


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cut=st.integers(0, 40),
    more=st.lists(st.integers(0, 3), max_size=10),
    sizes=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 3)]),
)
def test_rows_equal_the_slow_reference_through_rollbacks(seq, cut, more, sizes) -> None:
    draft = ngram(*sizes)
    rows = draft.evaluate(seq)
    assert proposals(rows) == [reference(seq[: i + 1], *sizes) for i in range(len(seq))]
    cut = min(cut, len(seq))
    draft.rollback(cut)
    kept = seq[: len(seq) - cut]
    again = draft.evaluate(more)
    whole = kept + more
    assert proposals(again) == [
        reference(whole[: len(kept) + i + 1], *sizes) for i in range(len(more))
    ]


def test_rollback_is_checked_and_reset_forgets_everything() -> None:
    draft = ngram()
    draft.evaluate([1, 2, 1])
    with pytest.raises(RollbackError, match="4.*holds 3"):
        draft.rollback(4)
    draft.reset()
    assert draft.length == 0
    assert proposals(draft.evaluate([1, 2]))[-1] is None  # nothing of [1, 2, 1] is left


def test_forks_draft_apart() -> None:
    draft = ngram()
    twin = draft.fork()
    draft.evaluate([1, 2, 1])
    assert twin.length == 0 and proposals(twin.evaluate([1]))[-1] is None


def test_identity_shares_the_targets_tokenizer_and_names_the_settings() -> None:
    a, b = ngram(1, 3), ngram(2, 3)
    require_shared_vocabulary(TARGET, a.identity)  # does not raise
    assert a.identity.tokenizer_digest == TARGET.tokenizer_digest
    assert len({TARGET.model_digest, a.identity.model_digest, b.identity.model_digest}) == 3
    assert a.identity.architecture == "ngram(1..3)"


def test_min_n_takes_effect_and_bad_settings_are_refused() -> None:
    seq = [1, 2, 9, 7, 2]  # only a 1-gram match: (2,) before 9
    assert proposals(ngram(1, 3).evaluate(seq))[-1] == 9
    assert proposals(ngram(2, 3).evaluate(seq))[-1] is None
    for bad in ({"min_n": 0}, {"max_n": True}, {"min_n": 3, "max_n": 2}):
        with pytest.raises(InvalidOverrideError, match="ngram"):
            ngram(**{"min_n": 1, "max_n": 3, **bad})


def test_the_context_window_is_the_targets_and_is_enforced() -> None:
    draft = ngram(context=4)
    draft.evaluate([1, 2, 3])
    with pytest.raises(ContextOverflowError, match="context_length is 4"):
        draft.evaluate([4, 5])
    assert draft.length == 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3, top_p=0.5),
    ],
)
def test_q_is_one_hot_at_every_temperature(params) -> None:
    row = ngram().evaluate([4, 5, 4])[-1]
    q = draft_row(row, params, q_top_k=VOCAB)
    assert q.ids.tolist() == [5] and q.weights.tolist() == [1.0]


def test_a_draft_with_no_match_drafts_nothing_and_a_match_follows_the_earlier_text() -> None:
    nothing = Drafter(ngram(), SamplingParams(temperature=0.0))
    assert nothing.draft([1, 2, 3], Mt19937.from_seed(5), depth=4).drafts == []
    sampled = Drafter(ngram(), SamplingParams(temperature=1.0, seed=3))
    made = sampled.draft([1, 2, 3, 1, 2], Mt19937.from_seed(5), depth=4)
    assert made.drafts == [3, 1, 2, 3]  # a chain keeps following what came after (1, 2)
    assert [q.ids.tolist() for q in made.q_rows] == [[3], [1], [2], [3]]


def reference_candidates(seq: list[int], min_n: int, max_n: int, limit: int = 16) -> dict:
    """A tree row the slow way: the earlier occurrences, longest n first and most recent
    first, each once (at its longest n), each weighing half the one before."""
    weights, seen, weight = {}, set(), 1.0
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        gram = seq[len(seq) - n :]
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == gram and end not in seen and len(seen) < limit:
                seen.add(end)
                weights[seq[end]] = weights.get(seq[end], 0.0) + weight
                weight /= 2
    return weights


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    after=st.lists(st.integers(0, 3), max_size=3),
    sizes=st.sampled_from([(1, 3), (2, 3), (2, 2)]),
)
def test_a_tree_row_equals_the_slow_reference_and_leaves_the_draft_as_it_was(seq, after, sizes):
    draft = ngram(*sizes)
    draft.evaluate(seq)
    row = draft.candidates(after)
    assert dict(zip(row.ids.tolist(), row.weights.tolist(), strict=True)) == (
        reference_candidates(seq + after, *sizes)
    )
    assert row.ids.tolist() == sorted(row.ids.tolist())
    assert draft.length == len(seq)  # `after` pushed and popped again
    assert draft.candidates(after).ids.tolist() == row.ids.tolist()
    again = ngram(*sizes)
    again.evaluate(seq + after)
    proposal = again.proposal()
    if proposal is None:
        assert row.ids.size == 0
    else:  # the heaviest candidate is the chain's proposal: a tree's first branch is the chain
        assert int(row.ids[np.argmax(row.weights)]) == proposal
        assert row.weights.max() > row.weights.sum() - row.weights.max()


def test_a_tree_row_reads_at_most_its_limit_of_occurrences() -> None:
    draft = ngram(1, 1)
    draft.evaluate([0, 1, 0, 2, 0, 3, 0, 1, 0])
    assert draft.candidates(limit=2).ids.tolist() == [1, 3]  # the two most recent
    # 1 followed the last 0 and the first, 3 and 2 the ones between: by id, 1, 2, 3
    assert draft.candidates().weights.tolist() == [1.0 + 0.125, 0.25, 0.5]


def test_a_lookup_tree_follows_the_earlier_passages() -> None:
    """`Drafter.tree_steps` on the n-gram draft: a greedy tree whose first branch is the
    chain's draft and whose other children are the other continuations seen; the draft is
    left holding the transcript (the next round evaluates what it emits)."""
    from proposer_mac.drafting import first_branch

    seq = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    drafter = Drafter(ngram(2, 3), params)
    tree = drafter.run(drafter.tree_steps(seq, Mt19937.from_seed(1), full_parents([2, 1, 1])))
    chain = Drafter(ngram(2, 3), params)
    line = chain.run(chain.draft_steps(seq, Mt19937.from_seed(1), 3))
    assert [tree.drafts[i] for i in first_branch(tree.parents)] == line.drafts == [7, 3, 5]
    assert tree.parents[:2] == [-1, -1] and sorted(tree.drafts[:2]) == [7, 8]
    assert drafter.cursor.tokens == seq
