"""Shared pieces of the cluster-file tests: a tiny model pair and a file editor."""

from __future__ import annotations

from pathlib import Path

import pytest

from muser_app.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): two seeds of one tiny architecture, sharing one tokenizer."""
    root = tmp_path_factory.mktemp("tiny-pair")
    return make_tiny_checkpoint(root / "t", seed=1), make_tiny_checkpoint(root / "d", seed=2)


@pytest.fixture
def unqualified(monkeypatch):
    """Skip the qualification receipt, for checks that should pass on tiny random models."""
    import cluster_config.qualification

    monkeypatch.setattr(cluster_config.qualification, "require_receipt", lambda config: None)


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    """Replace `old` (which must be there) in the file at `path`."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))
