"""`proposer.http` in the cluster file and the served model id (no daemons)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_config import load_config
from cluster_config.schema import ConfigError
from muser_app.cli.config import init_cluster
from proposer_mac.http_model import served_model_id


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


def test_served_model_name_flag_overrides_the_cluster_file(cluster_file):
    import argparse

    from cluster_config import load_config
    from muser_app.cli.main import build_parser
    from muser_app.cli.proposer import with_flags

    config = load_config(cluster_file)
    assert config.http.served_model_name == []
    args = build_parser().parse_args(
        ["proposer", "serve", "--config", str(cluster_file), "--served-model-name", "a", "b"]
    )
    assert with_flags(config, args).http.served_model_name == ["a", "b"]
    unset = argparse.Namespace(served_model_name=None)
    assert with_flags(config, unset) is config


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('served_model_name = ["smol", ""]', r"http.served_model_name.1: .*at least 1 character"),
        ('served_model_name = "smol"', r"http.served_model_name: .*valid list.*got 'smol'"),
        ("max_n = 0", r"http.max_n: .*greater than or equal to 1 \(got 0\)"),
        ("max_n = 2000", r"http.max_n: .*less than or equal to 1024 \(got 2000\)"),
    ],
)
def test_bad_api_settings_are_refused_naming_the_key(cluster_file, lines, message):
    text = cluster_file.read_text()
    section = "\n[http]\n" + lines + "\n" if "[http]" not in text else None
    assert section is not None, "config init writes no [http] without --api-key"
    cluster_file.write_text(text + section)
    with pytest.raises(ConfigError, match=message):
        load_config(cluster_file)


def test_api_settings_in_the_cluster_file_take_effect(cluster_file):
    cluster_file.write_text(
        cluster_file.read_text() + '\n[http]\nserved_model_name = ["smol"]\nmax_n = 3\n'
    )
    http = load_config(cluster_file).http
    assert (http.served_model_name, http.max_n) == (["smol"], 3)
