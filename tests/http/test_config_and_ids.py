"""`proposer.http` in the cluster file and the served model id (no daemons)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config.schema import ConfigError
from muser_app.cli.config import init_cluster
from proposer_mac.http_api import served_model_id


@pytest.fixture
def cluster_file(tmp_path, fixture_pair) -> Path:
    return init_cluster(tmp_path, target=fixture_pair.target, draft=fixture_pair.draft)


def test_config_init_writes_a_free_http_port_for_the_proposer(cluster_file):
    config = load_config(cluster_file)
    host, _, port = config.proposer.http.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert config.proposer.http != config.proposer.address


def test_a_bad_http_address_is_refused_and_quoted(cluster_file):
    http = load_config(cluster_file).proposer.http
    cluster_file.write_text(cluster_file.read_text().replace(http, "localhost"))
    with pytest.raises(ConfigError, match=r"proposer.http: .*HOST:PORT.*got 'localhost'"):
        load_config(cluster_file)


def test_served_model_id_is_the_checkpoint_folder_or_the_hub_repo(tmp_path):
    assert served_model_id(tmp_path / "natural" / "target") == "target"
    snapshot = tmp_path / "models--org--Tiny-Llama" / "snapshots" / "abc123"
    assert served_model_id(snapshot) == "org/Tiny-Llama"
