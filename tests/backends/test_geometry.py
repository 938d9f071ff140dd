"""Geometry comes from the checkpoint's own config.json; overrides are checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from muser.errors import InvalidOverrideError, ModelLoadError
from muser.geometry import read_geometry
from tests.backends.backend_helpers import PROMPT, build_backend


def _edit_config(path: Path, drop: tuple[str, ...] = (), **values) -> None:
    config = json.loads((path / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(values)
    (path / "config.json").write_text(json.dumps(config))


def test_geometry_is_read_from_the_checkpoint(checkpoint) -> None:
    path = checkpoint("mistral", sliding_window=4, layers=3, max_position_embeddings=96)
    geometry = read_geometry(path)
    assert geometry.context_length == 96
    assert geometry.num_layers == 3
    assert geometry.hidden_size == 64
    assert geometry.rope_theta == 10000.0
    assert geometry.sliding_window == 4


def test_nested_rope_theta_and_disabled_sliding_window(llama: Path, tmp_path: Path) -> None:
    path = Path(shutil.copytree(llama, tmp_path / "ckpt"))
    _edit_config(
        path,
        drop=("rope_theta",),
        rope_parameters={"rope_theta": 1234.5, "rope_type": "default"},
        sliding_window=16,
        use_sliding_window=False,
    )
    geometry = read_geometry(path)
    assert geometry.rope_theta == 1234.5
    assert geometry.sliding_window is None


def test_mlx_reads_nested_rope_theta_like_torch(checkpoint, tmp_path: Path) -> None:
    """The trap: mlx-lm's llama reads only top-level rope_theta and would default to 10000."""
    path = Path(shutil.copytree(checkpoint("llama", rope_theta=500.0), tmp_path / "ckpt"))
    _edit_config(path, drop=("rope_theta",))
    torch_rows = build_backend("torch", path).evaluate(PROMPT)
    mlx_rows = build_backend("mlx", path).evaluate(PROMPT)
    np.testing.assert_allclose(mlx_rows, torch_rows, rtol=0, atol=1e-4)


def test_overrides_replace_config_values(llama: Path) -> None:
    geometry = read_geometry(llama, context_length=32, rope_theta=77.0, sliding_window=8)
    assert (geometry.context_length, geometry.rope_theta, geometry.sliding_window) == (32, 77.0, 8)
    assert geometry.num_layers == 2


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("context_length", 0),
        ("context_length", -1),
        ("context_length", 1 << 25),
        ("context_length", 8.0),
        ("rope_theta", 0),
        ("rope_theta", float("nan")),
        ("rope_theta", "1e4"),
        ("sliding_window", 0),
        ("sliding_window", False),
    ],
)
def test_invalid_override_refused_naming_the_value(llama: Path, option: str, value) -> None:
    with pytest.raises(InvalidOverrideError, match=rf"{option} override {value!r}"):
        read_geometry(llama, **{option: value})


def test_invalid_config_value_refused_naming_the_field(llama: Path, tmp_path: Path) -> None:
    path = Path(shutil.copytree(llama, tmp_path / "ckpt"))
    _edit_config(path, drop=("max_position_embeddings",))
    with pytest.raises(ModelLoadError, match="max_position_embeddings in config.json None"):
        read_geometry(path)
    _edit_config(path, max_position_embeddings=64, num_hidden_layers=-2)
    with pytest.raises(ModelLoadError, match="num_hidden_layers in config.json -2"):
        read_geometry(path)


def test_rope_override_refused_for_a_checkpoint_without_rope(llama: Path, tmp_path: Path) -> None:
    path = Path(shutil.copytree(llama, tmp_path / "ckpt"))
    _edit_config(path, drop=("rope_theta", "rope_parameters"))
    assert read_geometry(path).rope_theta is None
    with pytest.raises(InvalidOverrideError, match="rope_theta override 5.0 refused: .* no rope"):
        read_geometry(path, rope_theta=5.0)
