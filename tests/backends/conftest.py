"""Fixtures for the backend tests: tiny local checkpoints and shared loaded backends.

Checkpoints and backends are session-scoped (loading is the slow part); every test that
uses a shared backend gets it reset. The identity cache goes to a temporary directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from muser_app.testing import make_tiny_checkpoint
from tests.backends.backend_helpers import build_backend, checkpoint_options


@pytest.fixture(scope="package", autouse=True)
def _identity_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Package scope: a session-wide MUSER_CACHE_DIR outlived this folder and sent every later
    # test (tests/lanes, ...) to rebuild the fixtures in the temporary cache (~2-3 min).
    cache = tmp_path_factory.mktemp("muser-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MUSER_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # tiny models on a shared 2-core box


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`checkpoint(arch, **kw)` → path of a tiny checkpoint, built once per argument set."""
    built: dict[tuple, Path] = {}

    def get(arch: str = "llama", **kw: object) -> Path:
        key = (arch, *sorted(kw.items()))
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[key] = make_tiny_checkpoint(out, arch=arch, **kw)
        return built[key]

    return get


@pytest.fixture(scope="session")
def llama(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="session")
def loaded(checkpoint: Callable[..., Path]) -> Callable[..., object]:
    """`loaded(kind, arch="llama", **opts)` → a shared backend, reset before it is returned."""
    cache: dict[tuple, object] = {}

    def get(kind: str, arch: str = "llama", **opts: object) -> object:
        key = (kind, arch, *sorted(opts.items()))
        if key not in cache:
            cache[key] = build_backend(kind, checkpoint(arch, **checkpoint_options(kind)), **opts)
        backend = cache[key]
        backend.reset()
        return backend

    return get
