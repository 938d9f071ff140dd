"""Losslessness past the first token: the joint distribution of the first three tokens the
local lane emits at T = 1 against the target's own, exactly computed. The first-token tests
(tests/core/test_verify.py) cannot see a residual drawn after an accepted draft, the bonus
from the last witness row, a second round chained on the first, a decode round, or a draft
row cut below the target's support; these runs go through all of them with the real
Drafter, judge and MT19937 stream (the round protocol the cluster lane shares)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from muser.sampling import SamplingParams, target_probs
from muser.width import FixedWidth
from muser_app.lanes.local import run_local
from tests.core.fake_backend import FakeBackend

VOCAB, PROMPT, LENGTH = 4, [1, 2], 3
Z_BOUND = 5.0
"""The chi-square statistic's Wilson-Hilferty normal score must stay under 5.0: a
false-failure probability of about 2.9e-7 per case (the normal tail beyond 5 sigma)."""


def pair():
    """Order-1 target and draft over 4 tokens, different enough that drafts are rejected
    about half the time."""
    return (
        FakeBackend(vocab=VOCAB, order=1, salt=11, sharpness=0.8),
        FakeBackend(vocab=VOCAB, order=1, salt=5, sharpness=0.8),
    )


def exact_joint(params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens) of the target alone: a Markov chain on the last token."""
    target, _ = pair()
    rows = {t: target_probs(target.evaluate([t])[-1], params) for t in range(VOCAB)}
    target.reset()
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p, prev = 1.0, PROMPT[-1]
        for token in seq:
            p, prev = p * rows[prev][token], token
        joint[seq] = p
    return joint


def wilson_hilferty(chi2: float, dof: int) -> float:
    return ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


@pytest.mark.parametrize(
    ("draft_len", "decode_len", "q_top_k", "top_k", "top_p", "runs"),
    [
        (2, 3, 2, 0, 1.0, 12_000),  # rows cut to 2 of 4 tokens; residuals, bonus, 2 rounds
        (3, 3, 4, 3, 0.9, 12_000),  # whole rows, the target's top-k and top-p on
        (0, 3, 4, 0, 1.0, 6_000),  # decode rounds: the verifier samples every token
    ],
)
def test_the_first_three_tokens_are_distributed_as_the_target_alone(
    draft_len, decode_len, q_top_k, top_k, top_p, runs
):
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=LENGTH)
    exact = exact_joint(params)
    target, draft = pair()
    counts: dict[tuple[int, ...], int] = {}
    for run in range(runs):
        target.reset()
        draft.reset()
        seeded = SamplingParams(
            temperature=1.0,
            top_k=top_k,
            top_p=top_p,
            max_tokens=LENGTH,
            seed=run * 2654435761 % 2**32,
        )
        width = FixedWidth(draft_len, decode_len)
        tokens = tuple(
            run_local(target, draft, PROMPT, seeded, q_top_k=q_top_k, width=width).tokens
        )
        counts[tokens] = counts.get(tokens, 0) + 1
    assert_distributed_as(counts, exact, runs)


def assert_distributed_as(counts: dict, exact: dict, runs: int) -> None:
    """A chi-square test of `counts` (sequences seen over `runs`) against `exact`."""
    impossible = sorted(seq for seq in counts if exact.get(seq, 0.0) == 0.0)
    assert not impossible, f"sequences the target never emits: {impossible[:5]}"
    cells = [seq for seq, p in exact.items() if p > 0]
    expected = np.array([exact[seq] * runs for seq in cells])
    observed = np.array([counts.get(seq, 0) for seq in cells])
    big = expected >= 5  # cells expected under 5 times are pooled into one
    chi2 = float((((observed - expected) ** 2) / expected)[big].sum())
    cells_used = int(big.sum())
    if (~big).any():
        pooled = expected[~big].sum()
        chi2 += float((observed[~big].sum() - pooled) ** 2 / pooled)
        cells_used += 1
    z = wilson_hilferty(chi2, cells_used - 1)
    assert z < Z_BOUND, (
        f"chi2 {chi2:.1f} on {cells_used - 1} degrees of freedom (normal score {z:.2f}): the "
        f"lane's first {LENGTH} tokens are not distributed as the target's (false-failure "
        "probability about 2.9e-7)"
    )


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3, 0.8)])
def test_the_ngram_draft_is_lossless_at_t1(top_k, top_p):
    """The n-gram draft's q is one-hot (proposer_mac/backends/ngram.py): accepted with
    probability p(x), else the residual is p without x. The prompt repeats, so rounds draft
    from lookups, follow them after rejections, and decode when nothing matches."""
    from proposer_mac.backends.ngram import NgramDraft

    prompt, runs = [1, 2, 1, 2], 12_000  # ends in 2, as PROMPT: the same exact joint
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=LENGTH)
    exact = exact_joint(params)
    target, _ = pair()
    draft = NgramDraft.over(target.identity, target.geometry, 1, 2)
    counts: dict[tuple[int, ...], int] = {}
    for run in range(runs):
        target.reset()
        draft.reset()
        seeded = SamplingParams(
            temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=LENGTH,
            seed=run * 2654435761 % 2**32,
        )  # fmt: skip
        tokens = tuple(
            run_local(target, draft, prompt, seeded, q_top_k=VOCAB, width=FixedWidth(2, 3)).tokens
        )
        counts[tokens] = counts.get(tokens, 0) + 1
    assert_distributed_as(counts, exact, runs)
