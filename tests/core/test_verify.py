"""Judging a linear round: fast path = float64 reference, losslessness, written edge rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from muser.errors import (
    DraftMismatchError,
    DraftZeroProbabilityError,
    InvalidWeightsError,
    RowCountError,
    RowWidthError,
    TokenOutOfVocabularyError,
)
from muser.mt19937 import Mt19937
from muser.sampling import SparseRow, sample_ordered
from muser.verify import judge_round, judge_round_reference


class ScriptedRng:
    """A draw source that returns chosen uniforms: lets a test integrate over u exactly."""

    def __init__(self, draws: list[float]):
        self.queue = list(draws)
        self.draws = 0

    def copy(self) -> ScriptedRng:
        other = ScriptedRng(self.queue)
        other.draws = self.draws
        return other

    def uniform_f64(self) -> float:
        self.draws += 1
        return self.queue.pop(0)


def dense_to_sparse(q: np.ndarray) -> SparseRow:
    ids = np.flatnonzero(q > 0).astype(np.int64)
    return SparseRow(ids, q[ids].astype(np.float64))


def random_round(gen: np.random.Generator, vocab: int, depth: int, rng: Mt19937, k: int):
    """A round as the proposer would build it: drafts drawn from sparse q with `rng`."""
    q_rows, drafts = [], []
    draw = rng.copy()
    for _ in range(depth):
        w = gen.dirichlet(np.full(vocab, 0.5))
        ids = np.sort(gen.choice(vocab, size=k, replace=False)).astype(np.int64)
        row = SparseRow(ids, w[ids] + 1e-3)
        q_rows.append(row)
        drafts.append(int(ids[sample_ordered(row.weights, draw.uniform_f64())]))
    witness = gen.dirichlet(np.full(vocab, 0.5), size=depth + 1)
    witness[gen.random((depth + 1, vocab)) < 0.2] = 0.0  # some p = 0 entries
    witness[:, 0] += 1e-9  # never an all-zero row
    return drafts, q_rows, witness


def test_fast_path_equals_float64_reference_under_the_same_draws():
    gen = np.random.default_rng(0)
    for trial in range(400):
        vocab, depth = int(gen.integers(2, 40)), int(gen.integers(0, 6))
        rng = Mt19937.from_seed(trial)
        drafts, q_rows, witness = random_round(gen, vocab, depth, rng, min(vocab, 5))
        for greedy in (False, True):
            if greedy:
                q_rows = [SparseRow(r.ids[[np.argmax(r.weights)]], np.array([1.0])) for r in q_rows]
                drafts = [int(r.ids[0]) for r in q_rows]
            fast = judge_round(rng, 0, drafts, q_rows, witness, greedy=greedy)
            ref = judge_round_reference(rng, 0, drafts, q_rows, witness, greedy=greedy)
            assert (fast.accepted, fast.next_frontier, fast.draws) == (
                ref.accepted,
                ref.next_frontier,
                ref.draws,
            )
            assert fast.post_state == ref.post_state


def test_judge_does_not_advance_the_callers_state():
    rng = Mt19937.from_seed(1)
    before = rng.to_bytes()
    gen = np.random.default_rng(1)
    drafts, q_rows, witness = random_round(gen, 10, 3, rng, 4)
    decision = judge_round(rng, 0, drafts, q_rows, witness, greedy=False)
    assert rng.to_bytes() == before
    assert decision.post_state != rng
    assert decision.draws == 3 + min(decision.accepted + 1, 3) + 1


def test_greedy_round_equals_argmax_decoding():
    gen = np.random.default_rng(2)
    vocab = 16
    for _ in range(200):
        witness = gen.random((5, vocab))
        argmax = [int(np.argmax(r)) for r in witness]
        # drafts agree with the target's argmax up to a random cut
        cut = int(gen.integers(0, 5))
        drafts = argmax[:cut] + [(t + 1) % vocab for t in argmax[cut:4]]
        q_rows = [SparseRow(np.array([d]), np.array([1.0])) for d in drafts]
        decision = judge_round(Mt19937.from_seed(0), 0, drafts, q_rows, witness, greedy=True)
        assert decision.accepted == cut
        assert decision.emitted(drafts) == argmax[: cut + 1]
        assert decision.draws == 0


def test_greedy_ties_go_to_the_lowest_id():
    witness = np.array([[0.1, 0.4, 0.4, 0.1]])
    decision = judge_round(Mt19937.from_seed(0), 0, [], [], witness, greedy=True)
    assert decision.next_frontier == 1


def _first_token_distribution(p_rows, q_rows_dense, depth):
    """Integrate the judge over every draw exactly: each draw's outcome is piecewise constant
    in u, so evaluating at interval midpoints weighted by interval lengths is exact."""
    vocab = p_rows.shape[1]
    q_rows = [dense_to_sparse(q) for q in q_rows_dense]
    dist = np.zeros(vocab)
    q0 = q_rows_dense[0]
    cum = np.concatenate([[0.0], np.cumsum(q_rows[0].weights)])
    for j, d in enumerate(q_rows[0].ids):
        mass_d = (cum[j + 1] - cum[j]) / cum[-1]
        u_draft = (cum[j] + cum[j + 1]) / 2 / cum[-1]
        later = [int(r.ids[0]) for r in q_rows[1:]]  # later drafts are irrelevant to token 0
        draws_later = [0.0] * (depth - 1)
        ratio = p_rows[0, d] / q0[d]
        # accepted: first emitted token is d itself
        if ratio > 0:
            dist[d] += mass_d * min(1.0, ratio)
        if ratio < 1:
            residual = np.maximum(p_rows[0] - q0, 0.0)
            if residual.sum() == 0:
                residual = p_rows[0]
            rc = np.concatenate([[0.0], np.cumsum(residual)])
            for x in np.flatnonzero(residual > 0):
                u_res = (rc[x] + rc[x + 1]) / 2 / rc[-1]
                u_acc = (1.0 + min(1.0, ratio)) / 2  # a rejecting draw
                script = [u_draft] + draws_later + [u_acc, u_res]
                drafts = [int(d)] + later
                decision = judge_round(ScriptedRng(script), 0, drafts, q_rows, p_rows, greedy=False)
                assert decision.accepted == 0
                dist[decision.next_frontier] += (
                    mass_d * (1 - min(1.0, ratio)) * ((rc[x + 1] - rc[x]) / rc[-1])
                )
    return dist


def test_analytic_first_token_distribution_equals_p():
    gen = np.random.default_rng(3)
    for _ in range(50):
        vocab = int(gen.integers(2, 12))
        p = gen.dirichlet(np.ones(vocab), size=2)
        p[0][gen.random(vocab) < 0.3] = 0.0
        p[0] /= p[0].sum() if p[0].sum() > 0 else 1
        if p[0].sum() == 0:
            p[0][0] = 1.0
        q = gen.dirichlet(np.ones(vocab))
        q[gen.random(vocab) < 0.3] = 0.0
        if q.sum() == 0:
            q[-1] = 1.0
        q /= q.sum()
        dist = _first_token_distribution(p, [q], 1)
        np.testing.assert_allclose(dist, p[0], rtol=0, atol=1e-12)


def test_statistical_first_token_matches_p_over_100k_rounds():
    """Seeded; with 100,000 rounds and a per-token two-sided z bound of 5.5 sigma, the
    false-failure probability is about 3.2e-7: the exact two-sided binomial tails of these 8
    tokens' counts at 5.5 sigma sum to 3.24e-7 (Bonferroni; the normal tails would say
    8 x 3.8e-8 = 3.1e-7, a little low for the rarer tokens)."""
    gen = np.random.default_rng(4)
    vocab, depth, rounds = 8, 2, 100_000
    p = gen.dirichlet(np.ones(vocab), size=depth + 1)
    q_dense = gen.dirichlet(np.ones(vocab) * 0.7, size=depth)
    q_rows = [SparseRow(np.arange(vocab), q) for q in q_dense]
    rng = Mt19937.from_seed(2026)
    counts = np.zeros(vocab)
    for _ in range(rounds):
        draft_rng = rng.copy()
        drafts = [int(sample_ordered(q, draft_rng.uniform_f64())) for q in q_dense]
        decision = judge_round(rng, 0, drafts, q_rows, p, greedy=False)
        counts[decision.emitted(drafts)[0]] += 1
        rng = decision.post_state
    expected = rounds * p[0]
    sigma = np.sqrt(rounds * p[0] * (1 - p[0]))
    z = np.abs(counts - expected) / sigma
    assert np.all(z < 5.5), (
        f"first-token counts {counts} vs expected {expected}: max z {z.max():.2f} "
        "(false-failure probability of this assertion < 3.1e-7)"
    )


# --- edge cases as written rules ---------------------------------------------------------


def row(*pairs):
    ids, w = zip(*pairs, strict=True)
    return SparseRow(np.array(ids, dtype=np.int64), np.array(w, dtype=np.float64))


def test_empty_draft_emits_one_token_from_p0_with_one_draw():
    witness = np.array([[0.0, 1.0, 0.0]])
    decision = judge_round(Mt19937.from_seed(0), 2, [], [], witness, greedy=False)
    assert (decision.accepted, decision.next_frontier, decision.draws) == (0, 1, 1)


def test_all_accepted_takes_the_bonus_from_the_last_row():
    witness = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q_rows = [row((1, 1.0)), row((2, 1.0))]
    decision = judge_round(Mt19937.from_seed(0), 0, [1, 2], q_rows, witness, greedy=False)
    assert decision.accepted == 2
    assert decision.emitted([1, 2]) == [1, 2, 0]


def test_first_rejected_samples_the_residual():
    # p puts nothing on the drafted token: it must be rejected; the residual is p itself here
    witness = np.array([[0.0, 0.0, 1.0], [1 / 3] * 3])
    decision = judge_round(
        Mt19937.from_seed(0), 0, [1], [row((1, 0.6), (2, 0.4))], witness, greedy=False
    )
    assert (decision.accepted, decision.next_frontier) == (0, 2)


def test_token_with_target_probability_zero_is_never_accepted_even_at_u_zero():
    witness = np.array([[0.5, 0.0, 0.5], [1 / 3] * 3])
    decision = judge_round(
        ScriptedRng([0.0, 0.0, 0.0]), 0, [1], [row((1, 1.0))], witness, greedy=False
    )
    assert decision.accepted == 0
    assert decision.next_frontier == 0


def test_acceptance_is_strictly_u_below_p_over_q():
    # p/q = 0.5 exactly; u = 0.5 must reject (never `<=`)
    witness = np.array([[0.25, 0.75], [0.5, 0.5]])
    q_rows = [row((0, 0.5), (1, 0.5))]
    rejected = judge_round(ScriptedRng([0.25, 0.5, 0.9]), 0, [0], q_rows, witness, greedy=False)
    accepted = judge_round(
        ScriptedRng([0.25, 0.4999999, 0.9]), 0, [0], q_rows, witness, greedy=False
    )
    assert rejected.accepted == 0 and rejected.next_frontier == 1
    assert accepted.accepted == 1


def test_residual_that_sums_to_zero_falls_back_to_p():
    # p (unnormalised here) is below q everywhere: max(p - q, 0) is all zero
    witness = np.array([[0.2, 0.2, 0.0], [1 / 3] * 3])
    q_rows = [row((0, 0.5), (1, 0.5))]
    decision = judge_round(ScriptedRng([0.1, 0.9, 0.75]), 0, [0], q_rows, witness, greedy=False)
    assert decision.accepted == 0
    assert decision.next_frontier == 1  # sample_ordered(p_0, 0.75) over [0.2, 0.2, 0]


def test_vocabulary_boundary_tokens():
    vocab = 5
    witness = np.zeros((2, vocab))
    witness[0, vocab - 1] = 1.0
    witness[1, 0] = 1.0
    ok = judge_round(
        Mt19937.from_seed(0), 0, [vocab - 1], [row((vocab - 1, 1.0))], witness, greedy=False
    )
    assert ok.emitted([vocab - 1]) == [vocab - 1, 0]
    with pytest.raises(TokenOutOfVocabularyError, match=r"draft 0 token 5 outside .*\[0, 5\)"):
        judge_round(Mt19937.from_seed(0), 0, [vocab], [row((vocab, 1.0))], witness, greedy=False)
    with pytest.raises(TokenOutOfVocabularyError, match="frontier token -1"):
        judge_round(Mt19937.from_seed(0), -1, [0], [row((0, 1.0))], witness, greedy=False)


@pytest.mark.parametrize(
    ("drafts", "q_rows", "witness", "error", "message"),
    [
        ([1], [row((1, 0.0), (2, 1.0))], np.full((2, 4), 0.25), DraftZeroProbabilityError, "q = 0"),
        ([3], [row((1, 0.5), (2, 0.5))], np.full((2, 4), 0.25), DraftZeroProbabilityError, "q = 0"),
        ([1], [row((1, math.nan))], np.full((2, 4), 0.25), InvalidWeightsError, "finite"),
        ([1], [row((1, -0.1), (2, 1.0))], np.full((2, 4), 0.25), InvalidWeightsError, ">= 0"),
        ([1], [row((1, 0.0))], np.full((2, 4), 0.25), InvalidWeightsError, "all zero"),
        ([1], [row((2, 0.5), (1, 0.5))], np.full((2, 4), 0.25), InvalidWeightsError, "ascending"),
        (
            [1],
            [row((1, 1.0)), row((1, 1.0))],
            np.full((2, 4), 0.25),
            RowCountError,
            "1 draft rows, got 2",
        ),
        ([1], [row((1, 1.0))], np.full((3, 4), 0.25), RowCountError, "2 witness rows, got shape"),
        ([1], [row((1, 1.0))], np.full((2, 4), -0.25), InvalidWeightsError, "witness row 0"),
        ([1], [row((1, 1.0))], np.zeros((2, 4)), InvalidWeightsError, "all zero"),
        ([1], [row((7, 1.0))], np.full((2, 4), 0.25), TokenOutOfVocabularyError, "token id 7"),
    ],
)
def test_refusals_happen_before_any_draw(drafts, q_rows, witness, error, message):
    rng = ScriptedRng([])  # any draw would raise IndexError
    with pytest.raises(error, match=message):
        judge_round(rng, 0, drafts, q_rows, witness, greedy=False)
    with pytest.raises(error, match=message):
        judge_round_reference(rng, 0, drafts, q_rows, witness, greedy=False)


def test_row_width_must_be_the_vocabulary():
    from muser.verify import validate_round

    with pytest.raises(RowWidthError, match="must be 8 wide"):
        validate_round(0, [1], [row((1, 1.0))], np.full((2, 4), 0.25), 8)


def test_drafts_the_replayed_draws_do_not_select_are_refused():
    rng = Mt19937.from_seed(5)
    q = row((0, 0.5), (1, 0.5))
    chosen = int(q.ids[sample_ordered(q.weights, rng.copy().uniform_f64())])
    other = 1 - chosen
    witness = np.full((2, 2), 0.5)
    with pytest.raises(
        DraftMismatchError, match=f"selects token {chosen}, the request declares {other}"
    ):
        judge_round(rng, 0, [other], [q], witness, greedy=False)
    greedy_q = row((0, 0.3), (1, 0.7))
    with pytest.raises(DraftMismatchError, match="selects token 1"):
        judge_round(rng, 0, [0], [greedy_q], witness, greedy=True)
