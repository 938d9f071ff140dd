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
from muser.identity import require_shared_tokenizer
from muser.mt19937 import Mt19937
from muser.sampling import SamplingParams, draft_row
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
    require_shared_tokenizer(TARGET, a.identity)  # does not raise
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
