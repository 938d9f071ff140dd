"""torch and mlx agree on the same checkpoint, for every fixture architecture."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import ContextOverflowError
from muser_app.testing import ARCHES
from tests.backends.backend_helpers import PROMPT, build_backend, float64_rows


@pytest.mark.parametrize("arch", ARCHES)
def test_torch_and_mlx_rows_agree(arch: str, loaded) -> None:
    torch_rows = loaded("torch", arch).evaluate(PROMPT)
    mlx = loaded("mlx", arch)
    mlx_rows = np.concatenate([mlx.evaluate(PROMPT[:7])] + [mlx.evaluate([t]) for t in PROMPT[7:]])
    assert loaded("torch", arch).identity == mlx.identity
    np.testing.assert_allclose(mlx_rows, torch_rows, rtol=0, atol=1e-4)


def test_sliding_window_is_honoured_by_torch_and_capped_by_mlx(checkpoint) -> None:
    """Mistral with sliding_window 4: torch's full-length cache still masks to the window."""
    path = checkpoint("mistral", sliding_window=4)
    torch_backend = build_backend("torch", path)
    assert torch_backend.geometry.sliding_window == 4
    rows = np.concatenate(
        [torch_backend.evaluate(PROMPT[:5])] + [torch_backend.evaluate([t]) for t in PROMPT[5:]]
    )
    np.testing.assert_allclose(rows, float64_rows(path, PROMPT), rtol=0, atol=1e-4)
    unwindowed = float64_rows(path, PROMPT, sliding_window=None)
    assert np.abs(rows[:4] - unwindowed[:4]).max() < 1e-4  # same until the window is full
    assert np.abs(rows[4:] - unwindowed[4:]).max(axis=1).min() > 0.05
    # mlx-lm's llama/mistral ignores a uniform window, so the mlx draft refuses past it.
    mlx = build_backend("mlx", path)
    np.testing.assert_allclose(mlx.evaluate(PROMPT[:4]), rows[:4], rtol=0, atol=1e-4)
    with pytest.raises(
        ContextOverflowError, match=r"5 tokens.*context_length is 4.*sliding_window"
    ):
        mlx.evaluate([PROMPT[4]])


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_forked_draft_sequence_gives_bit_equal_rows_and_its_own_kv(kind, checkpoint):
    """The proposer drafts each session on `fork()`: same forward, its own KV."""
    import numpy as np

    from proposer_mac.backends import load_draft_backend

    draft = load_draft_backend(kind, checkpoint("llama"))
    tokens = list(range(5, 45))
    first = draft.evaluate(tokens[:30])
    other = draft.fork()  # another session drafts in between, on its own KV
    other.evaluate(tokens[::-1][:20])
    other.rollback(3)
    assert (other.length, draft.length) == (17, 30)
    later = draft.evaluate(tokens[30:])
    twin = draft.fork()  # the same chunks on a fresh fork: the very same rows
    assert np.array_equal(twin.evaluate(tokens[:30]), first)
    assert np.array_equal(twin.evaluate(tokens[30:]), later)
