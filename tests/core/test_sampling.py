"""Target-side transforms, sparse draft rows and sample_ordered."""

import math

import numpy as np
import pytest

from muser.errors import InvalidSamplingParamsError, InvalidWeightsError, TokenOutOfVocabularyError
from muser.sampling import SamplingParams, SparseRow, draft_row, sample_ordered, target_probs


def test_greedy_rows_are_one_hot_lowest_id_on_ties():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    p = target_probs(logits, SamplingParams(temperature=0.0))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_softmax_in_float64():
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    p = target_probs(logits, SamplingParams(temperature=0.5))
    expected = np.exp(np.array([0.0, 2.0, 4.0]))
    expected /= expected.sum()
    assert p.dtype == np.float64
    np.testing.assert_allclose(p, expected, rtol=1e-15)


def test_top_k_keeps_the_k_largest_and_ties_at_the_kth():
    logits = np.array([1.0, 4.0, 3.0, 3.0, 0.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.flatnonzero(p).tolist() == [1, 2, 3]  # the tie at the 2nd value stays
    p1 = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert p1.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = np.array([0.1, 0.5, 0.3, 0.1])
    p = target_probs(np.log(probs), SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(p, [0.0, 0.625, 0.375, 0.0], rtol=1e-12)
    p_small = target_probs(np.log(probs), SamplingParams(temperature=1.0, top_p=0.01))
    assert np.flatnonzero(p_small).tolist() == [1]


def test_draft_row_truncates_to_q_top_k_in_ascending_ids():
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0])
    q = draft_row(logits, SamplingParams(temperature=1.0), q_top_k=3)
    assert q.ids.tolist() == [1, 2, 3]
    full = target_probs(logits, SamplingParams(temperature=1.0))
    np.testing.assert_array_equal(q.weights, full[[1, 2, 3]])
    g = draft_row(logits, SamplingParams(), q_top_k=3)
    assert (g.ids.tolist(), g.weights.tolist()) == ([1], [1.0])


def test_sample_ordered_walks_ascending_ids():
    w = np.array([0.0, 0.25, 0.0, 0.75])
    assert sample_ordered(w, 0.0) == 1
    assert sample_ordered(w, 0.2499) == 1
    assert sample_ordered(w, 0.25) == 3  # cumulative must exceed u*Z strictly
    assert sample_ordered(w, math.nextafter(1.0, 0.0)) == 3


def test_sample_ordered_never_returns_a_trailing_zero_weight():
    w = np.array([0.3, 0.7, 0.0, 0.0])
    assert sample_ordered(w, math.nextafter(1.0, 0.0)) == 1


def test_sparse_probability_and_dense():
    q = SparseRow(np.array([2, 5]), np.array([1.0, 3.0]))
    assert q.probability(5) == 0.75 and q.probability(3) == 0.0
    assert q.dense(6).tolist() == [0, 0, 0.25, 0, 0, 0.75]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "got 1.5"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"seed": -3}, "seed"),
    ],
)
def test_invalid_sampling_params_refused_with_the_value(kwargs, message):
    with pytest.raises(InvalidSamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_q_top_k_must_be_positive():
    with pytest.raises(InvalidSamplingParamsError, match="q_top_k must be >= 1, got 0"):
        draft_row(np.zeros(3), SamplingParams(temperature=1.0), q_top_k=0)


def test_top_k_ids_equals_a_stable_descending_sort_including_ties():
    from muser.sampling import top_k_ids

    gen = np.random.default_rng(0)
    for _ in range(300):
        p = gen.integers(0, 6, size=int(gen.integers(1, 40))).astype(np.float64)
        k = int(gen.integers(1, p.size + 1))
        expected = np.sort(np.argsort(-p, kind="stable")[:k])
        assert top_k_ids(p, k).tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("ids", "weights", "error", "message"),
    [
        ([1, 1000], [0.5, 0.5], TokenOutOfVocabularyError, "token id 1000"),
        ([-1, 2], [0.5, 0.5], TokenOutOfVocabularyError, "token id -1"),
        ([2, 1], [0.5, 0.5], InvalidWeightsError, "ascending"),
        ([1, 1], [0.5, 0.5], InvalidWeightsError, "ascending"),
        ([1, 2], [math.nan, 0.5], InvalidWeightsError, "finite"),
        ([1, 2], [math.inf, 0.5], InvalidWeightsError, "finite"),
        ([1, 2], [-0.1, 1.0], InvalidWeightsError, ">= 0"),
        ([1, 2], [0.0, 0.0], InvalidWeightsError, "all zero"),
        ([1, 2], [0.5], InvalidWeightsError, "equal-length"),
        ([], [], InvalidWeightsError, "non-empty"),
    ],
)
@pytest.mark.parametrize("pad", [0, 40], ids=["short row", "long row"])
def test_sparse_rows_short_and_long_are_refused_alike(ids, weights, error, message, pad):
    """Short rows are checked value by value, long ones in numpy: the same defects are
    refused either way, with the same message (`pad` appends valid entries, so the long
    row is past `_SCALAR_ROW`)."""
    from muser.sampling import _SCALAR_ROW

    padded = bool(pad and ids and len(ids) == len(weights))
    extra = list(range(100, 100 + pad)) if padded else []
    row = SparseRow(np.array(ids + extra, dtype=np.int64), np.array(weights + [0.0] * len(extra)))
    assert (row.ids.size > _SCALAR_ROW) == padded
    with pytest.raises(error, match=message):
        row.validate(1000, "draft row 0")
    extra = list(range(100, 100 + pad))
    ok = SparseRow(np.array([1, 3] + extra, dtype=np.int64), np.array([0.0, 2.0] + [1.0] * pad))
    ok.validate(1000, "draft row 0")
    assert ok.probability(3) == 2.0 / (2.0 + pad) and ok.probability(1) == 0.0
