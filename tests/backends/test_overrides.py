"""Every override is watched taking effect (docs/design.md §9)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import ContextOverflowError, InvalidOverrideError
from tests.backends.backend_helpers import PROMPT, build_backend, float64_rows

THETA = 500.0  # the fixtures are saved with rope_theta 10000


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_rope_theta_override_changes_logits_at_later_positions(kind: str, loaded) -> None:
    base = loaded(kind).evaluate(PROMPT)
    backend = loaded(kind, rope_theta=THETA)
    assert backend.geometry.rope_theta == THETA
    rows = backend.evaluate(PROMPT)
    # Position 0 rotates by angle 0 whatever theta is; every later position moves.
    np.testing.assert_allclose(rows[0], base[0], rtol=0, atol=1e-6)
    assert np.abs(rows[1:] - base[1:]).max(axis=1).min() > 1e-3
    assert np.abs(rows - base).max() > 0.1


def test_rope_theta_override_matches_the_reference_on_both_backends(loaded, llama) -> None:
    rope = {"rope_theta": THETA, "rope_type": "default"}
    reference = float64_rows(llama, PROMPT, rope_parameters=rope)
    for kind in ("torch", "mlx"):
        rows = loaded(kind, rope_theta=THETA).evaluate(PROMPT)
        np.testing.assert_allclose(rows, reference, rtol=0, atol=1e-4, err_msg=kind)


def test_rope_theta_override_equal_to_the_checkpoint_changes_nothing(loaded) -> None:
    same = loaded("torch", rope_theta=10000.0).evaluate(PROMPT)
    np.testing.assert_array_equal(same, loaded("torch").evaluate(PROMPT))


@pytest.mark.parametrize("kind", ["torch", "mlx", "windowed"])
def test_context_length_override_moves_the_refusal_point(kind: str, loaded) -> None:
    backend = loaded(kind, context_length=8)
    assert backend.geometry.context_length == 8
    backend.evaluate(PROMPT[:5])
    backend.evaluate(PROMPT[5:8])
    with pytest.raises(ContextOverflowError, match=r"9 tokens.*context_length is 8"):
        backend.evaluate([PROMPT[8]])
    with pytest.raises(ContextOverflowError, match=r"10 tokens.*context_length is 8"):
        backend.evaluate(PROMPT[8:10])
    assert backend.length == 8  # refused before anything was computed
    backend.rollback(1)
    assert backend.evaluate([PROMPT[8]]).shape == (1, 320)
    assert loaded(kind).evaluate(PROMPT[:9]).shape == (9, 320)  # no override: 9 fits


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_context_length_override_can_exceed_the_checkpoint(kind: str, loaded) -> None:
    default = loaded(kind)
    assert default.geometry.context_length == 256
    default.evaluate([7] * 256)
    with pytest.raises(ContextOverflowError, match="257 tokens.*context_length is 256"):
        default.evaluate([7])
    longer = loaded(kind, context_length=300)
    longer.evaluate([7] * 256)
    assert longer.evaluate([7]).shape == (1, 320)


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("context_length", 0),
        ("context_length", -4),
        ("context_length", 1 << 30),
        ("context_length", True),
        ("rope_theta", 0.0),
        ("rope_theta", -1.0),
        ("rope_theta", float("nan")),
        ("rope_theta", float("inf")),
    ],
)
def test_invalid_override_refused_naming_the_value(kind: str, option: str, value, llama) -> None:
    with pytest.raises(InvalidOverrideError, match=rf"{option} override {value!r}"):
        build_backend(kind, llama, **{option: value})


@pytest.mark.parametrize("inner_kind", ["torch", "mlx"])
def test_window_two_rows_come_from_the_last_two_tokens_only(inner_kind: str, loaded) -> None:
    from proposer_mac.backends.windowed import WindowedBackend

    inner = loaded(inner_kind)
    windowed = WindowedBackend(inner, 2)
    rows = np.concatenate(
        [windowed.evaluate(PROMPT[:6])] + [windowed.evaluate([t]) for t in PROMPT[6:]]
    )
    assert windowed.length == len(PROMPT)
    full = loaded(inner_kind).evaluate(PROMPT)
    for i in range(len(PROMPT)):
        inner.reset()
        alone = inner.evaluate(PROMPT[max(0, i - 1) : i + 1])[-1]
        np.testing.assert_array_equal(rows[i], alone, err_msg=f"row {i}")
    np.testing.assert_allclose(rows[:2], full[:2], rtol=0, atol=1e-5)  # window covers all
    assert np.abs(rows[2:] - full[2:]).max(axis=1).min() > 1e-3


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_window_below_one_or_not_an_integer_refused(window, loaded) -> None:
    from proposer_mac.backends.windowed import WindowedBackend

    with pytest.raises(InvalidOverrideError, match=rf"draft window {window!r}"):
        WindowedBackend(loaded("torch"), window)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_option_takes_effect_and_rows_stay_float64(dtype: str, loaded) -> None:
    rows = loaded("torch", dtype=dtype).evaluate(PROMPT)
    reference = loaded("torch").evaluate(PROMPT)
    assert rows.dtype == np.float64
    difference = np.abs(rows - reference).max()
    assert 0 < difference < 0.5, difference


def test_unknown_dtype_and_bad_threads_refused(llama) -> None:
    with pytest.raises(InvalidOverrideError, match="'float64'"):
        build_backend("torch", llama, dtype="float64")
    with pytest.raises(InvalidOverrideError, match="threads 0"):
        build_backend("torch", llama, threads=0)


def test_mlx_device_is_chosen_and_reported(llama) -> None:
    import mlx.core as mx

    from proposer_mac.backends.mlx_draft import MlxBackend

    auto = MlxBackend(llama, device="auto")
    assert auto.device == ("gpu" if mx.metal.is_available() else "cpu")
    assert MlxBackend(llama, device="cpu").device == "cpu"
    with pytest.raises(InvalidOverrideError, match="'tpu'"):
        MlxBackend(llama, device="tpu")
    if not mx.is_available(mx.gpu):
        with pytest.raises(InvalidOverrideError, match="'gpu' requested"):
            MlxBackend(llama, device="gpu")
