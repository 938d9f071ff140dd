"""One contract for every backend (muser.backend.ModelBackend), written once.

`BackendContract` holds the assertions; a test module subclasses it and supplies the `kind`
fixture: `test_contract.py` runs it against torch, mlx and the windowed wrapper in the
default suite, `test_vllm_backend.py` against vllm under the `vllm` marker (in .venv-vllm).
Where the windowed semantics differ (which tokens a row sees), the float64 reference is
windowed too. Capture is a declared capability: a target kind in `CAPTURE_KINDS` has
`evaluate_capture` and its rows match, any other backend has none.
"""

from __future__ import annotations

import numpy as np
import pytest

from muser.backend import ModelBackend
from muser.errors import RollbackError, TokenOutOfVocabularyError
from tests.backends.backend_helpers import PROMPT, checkpoint_options, float64_rows
from verifier_gx.backends import CAPTURE_KINDS


def softmax64(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=1, keepdims=True)
    return np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)


class BackendContract:
    """Subclass as `Test…` and define a `kind` fixture."""

    @pytest.fixture
    def backend(self, kind: str, loaded):
        return loaded(kind)

    @pytest.fixture
    def path(self, kind: str, checkpoint):
        """The checkpoint the `kind` backend was loaded from (for the float64 reference)."""
        return checkpoint("llama", **checkpoint_options(kind))

    def test_backend_satisfies_the_protocol(self, backend) -> None:
        assert isinstance(backend, ModelBackend)
        assert backend.vocab_size == backend.identity.vocab_size == 320
        assert backend.length == 0

    def test_evaluate_returns_float64_rows_and_appends(self, backend) -> None:
        rows = backend.evaluate(PROMPT[:5])
        assert rows.shape == (5, backend.vocab_size)
        assert rows.dtype == np.float64
        assert np.isfinite(rows).all()
        assert backend.length == 5
        empty = backend.evaluate([])
        assert empty.shape == (0, backend.vocab_size) and empty.dtype == np.float64
        assert backend.length == 5

    def test_incremental_evaluation_equals_one_shot(self, backend) -> None:
        one_shot = backend.evaluate(PROMPT)
        backend.reset()
        parts = [backend.evaluate(PROMPT[:6]), backend.evaluate(PROMPT[6:11])]
        parts += [backend.evaluate([t]) for t in PROMPT[11:]]
        incremental = np.concatenate(parts)
        assert backend.length == len(PROMPT)
        np.testing.assert_allclose(incremental, one_shot, rtol=0, atol=1e-5)

    def test_rollback_then_reevaluate_reproduces_rows_exactly(self, backend) -> None:
        backend.evaluate(PROMPT[:8])
        before = backend.evaluate(PROMPT[8:12])
        step = backend.evaluate([PROMPT[12]])
        backend.rollback(5)
        assert backend.length == 8
        backend.evaluate([1, 2, 3])  # a rejected continuation, then rewind again
        backend.rollback(3)
        np.testing.assert_array_equal(backend.evaluate(PROMPT[8:12]), before)
        np.testing.assert_array_equal(backend.evaluate([PROMPT[12]]), step)

    def test_rollback_refuses_negative_and_too_large_counts(self, backend) -> None:
        backend.evaluate(PROMPT[:4])
        expected = backend.evaluate([PROMPT[4]])
        backend.rollback(1)
        for n in (-1, 5, 100):
            with pytest.raises(RollbackError, match=rf"{n}.*holds 4"):
                backend.rollback(n)
        assert backend.length == 4  # a refused rollback changes nothing
        np.testing.assert_array_equal(backend.evaluate([PROMPT[4]]), expected)
        backend.rollback(5)  # exactly `length` is allowed
        assert backend.length == 0

    def test_reset_drops_the_sequence(self, backend) -> None:
        first = backend.evaluate(PROMPT[:3])
        backend.evaluate(PROMPT[3:6])
        backend.reset()
        assert backend.length == 0
        np.testing.assert_allclose(backend.evaluate(PROMPT[:3]), first, rtol=0, atol=1e-6)

    def test_out_of_vocabulary_token_refused_before_evaluating(self, backend) -> None:
        backend.evaluate(PROMPT[:2])
        for bad in (backend.vocab_size, -1, 2.0):
            with pytest.raises(TokenOutOfVocabularyError, match=str(bad)):
                backend.evaluate([5, bad])
        assert backend.length == 2

    def test_rows_softmax_sums_to_one_and_rows_spread(self, backend) -> None:
        rows = backend.evaluate(PROMPT)
        np.testing.assert_allclose(softmax64(rows).sum(axis=1), 1.0, rtol=0, atol=1e-12)
        # Unit-scale fixture weights: logits spread by ~1 nat, so 1e-4 comparisons discriminate.
        assert rows.std(axis=1).min() > 0.3

    def test_rows_match_float64_recomputation(self, kind: str, backend, path) -> None:
        window = backend.window if kind == "windowed" else None
        rows = np.concatenate(
            [backend.evaluate(PROMPT[:9])] + [backend.evaluate([t]) for t in PROMPT[9:]]
        )
        reference = float64_rows(path, PROMPT, window=window)
        np.testing.assert_allclose(rows, reference, rtol=0, atol=1e-4)
        # The witness rows are probabilities: those agree to 1e-4 absolute as well.
        np.testing.assert_allclose(softmax64(rows), softmax64(reference), rtol=0, atol=1e-4)

    def test_capture_capability_is_declared(self, kind: str, backend, path) -> None:
        if kind not in CAPTURE_KINDS:
            assert not hasattr(backend, "evaluate_capture")
            return
        logits, hidden = backend.evaluate_capture(PROMPT, [0])
        np.testing.assert_allclose(logits, float64_rows(path, PROMPT), rtol=0, atol=1e-4)
        assert hidden[0].shape == (len(PROMPT), backend.geometry.hidden_size)
        assert backend.length == len(PROMPT)
