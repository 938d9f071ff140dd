"""Backend selection by kind: the two loader functions and their refusals."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from muser.errors import InvalidOverrideError, UnknownBackendError
from proposer_mac.backends import DRAFT_KINDS, load_draft_backend
from tests.backends.backend_helpers import PROMPT
from verifier_gx.backends import TARGET_KINDS, load_target_backend


def test_loaders_build_each_kind(llama) -> None:
    from muser_torch.backend import TorchBackend
    from proposer_mac.backends.mlx_draft import MlxBackend
    from proposer_mac.backends.torch_draft import TorchDraftBackend

    target = load_target_backend("torch", llama, context_length=64)
    assert type(target) is TorchBackend and target.geometry.context_length == 64
    assert isinstance(load_draft_backend("torch", llama), TorchDraftBackend)
    mlx = load_draft_backend("mlx", llama, device="cpu")
    assert isinstance(mlx, MlxBackend) and mlx.device == "cpu"
    np.testing.assert_allclose(mlx.evaluate(PROMPT), target.evaluate(PROMPT), rtol=0, atol=1e-4)


def test_draft_window_option_wraps_the_backend(llama) -> None:
    from proposer_mac.backends.windowed import WindowedBackend

    draft = load_draft_backend("mlx", llama, window=4, device="cpu")
    assert isinstance(draft, WindowedBackend) and draft.window == 4
    assert draft.device == "cpu"


@pytest.mark.parametrize("kind", ["mlx", "", "TORCH", "VLLM"])
def test_unknown_target_kind_refused_listing_valid_kinds(kind: str, llama) -> None:
    with pytest.raises(UnknownBackendError, match=rf"{kind!r}.*valid kinds are torch, vllm"):
        load_target_backend(kind, llama)
    assert TARGET_KINDS == ("torch", "vllm")


def test_vllm_target_without_vllm_installed_says_how_to_get_it(llama) -> None:
    """The default environment has no vLLM (it lives in .venv-vllm, `make vllm-env`)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here; tests/backends/test_vllm_backend.py covers it")
    with pytest.raises(UnknownBackendError, match=r"needs the vllm package.*make vllm-env"):
        load_target_backend("vllm", llama)
    with pytest.raises(InvalidOverrideError, match=r"vllm backend does not take.*\['threads'\]"):
        load_target_backend("vllm", llama, threads=1)


@pytest.mark.parametrize("kind", ["vllm", "metal", "MLX"])
def test_unknown_draft_kind_refused_listing_valid_kinds(kind: str, llama) -> None:
    with pytest.raises(
        UnknownBackendError, match=rf"{kind!r}.*valid kinds are mlx, torch, conditioned, ngram"
    ):
        load_draft_backend(kind, llama)
    assert DRAFT_KINDS == ("mlx", "torch", "conditioned", "ngram")


def test_unknown_option_refused_listing_known_ones(llama) -> None:
    with pytest.raises(InvalidOverrideError, match=r"\['dtype'\].*device"):
        load_draft_backend("mlx", llama, dtype="float16")
    with pytest.raises(InvalidOverrideError, match=r"\['windw'\]"):
        load_target_backend("torch", llama, windw=3)
