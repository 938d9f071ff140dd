"""A real two-daemon cluster on loopback, per test, on the fixture pair."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster_config import ClusterConfig, load_config
from tests.cluster.harness import Daemon


@dataclass
class Cluster:
    dir: Path
    config_path: Path
    config: ClusterConfig
    verifier: Daemon
    proposer: Daemon

    @property
    def address(self) -> str:
        return self.config.proposer.address

    def start(self) -> None:
        self.verifier.start()
        self.proposer.start()

    def stop(self) -> None:
        self.proposer.stop()
        self.verifier.stop()


@pytest.fixture(scope="session")
def fixture_pair():
    from muser_app.fixtures import build_fixtures

    return build_fixtures(progress=False).natural


def make_cluster(
    directory: Path, pair, *, draft_len: int = 4, edit=None, draft_kind: str | None = None
) -> Cluster:
    """A qualified loopback cluster on `pair`; `draft_kind="ngram"` drafts by prompt lookup
    on the pair's target instead of running its draft."""
    from muser_app.cli.config import init_cluster
    from tests.qualify.receipts import qualified_receipt

    draft = None if draft_kind == "ngram" else pair.draft
    path = init_cluster(
        directory, target=pair.target, draft=draft, draft_len=draft_len, draft_kind=draft_kind
    )
    if edit is not None:
        path.write_text(edit(path.read_text()))
    config = load_config(path)
    qualified_receipt(config)  # one real qualification per lane, signed for each cluster's key
    return Cluster(
        directory,
        path,
        config,
        Daemon("verifier", path, directory),
        Daemon("proposer", path, directory),
    )


@pytest.fixture
def cluster(tmp_path, fixture_pair):
    c = make_cluster(tmp_path, fixture_pair)
    c.start()
    yield c
    c.stop()
