"""The fixture pair, and throwaway clusters on it (keys and cluster.toml, no daemons)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fixture_pair():
    from muser_app.fixtures import build_fixtures

    return build_fixtures(progress=False).natural


@pytest.fixture
def new_cluster(tmp_path, fixture_pair):
    """`new_cluster(target=None) -> cluster.toml` in a fresh directory, fresh keys."""
    from muser_app.cli.config import init_cluster

    made = []

    def make(target: Path | None = None) -> Path:
        directory = tmp_path / f"cluster{len(made)}"
        made.append(directory)
        return init_cluster(
            directory, target=target or fixture_pair.target, draft=fixture_pair.draft
        )

    return make
