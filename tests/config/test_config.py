"""cluster.toml: strict schema, refusal rules, keygen, `muser config` exit codes."""

from __future__ import annotations

import json
import stat

import pytest

from cluster_config import load_config
from cluster_config.rules import check_rules
from cluster_config.schema import ConfigError
from muser.cli.config import init_cluster
from muser.cli.main import main
from muser.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_tiny_checkpoint(root / "t", seed=1), make_tiny_checkpoint(root / "d", seed=2)


@pytest.fixture
def cluster_file(tmp_path, models):
    return init_cluster(tmp_path / "c", target=models[0], draft=models[1])


def test_init_writes_a_config_that_checks(cluster_file, unqualified, capsys):
    cfg = load_config(cluster_file)
    check_rules(cfg)
    assert cfg.verifier.address != cfg.proposer.address
    assert cfg.verifier.key.is_absolute() and cfg.verifier.key.exists()
    assert main(["config", "check", str(cluster_file)]) == 0
    assert "ok" in capsys.readouterr().out


class _LowestFreePort:
    """A socket whose bind to port 0 takes the lowest port no open socket holds, the way a
    kernel may hand a just-released port out again."""

    held: set[int] = set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.held.discard(self.port)

    def bind(self, address):
        self.port = min(set(range(20000, 20010)) - self.held)
        self.held.add(self.port)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_init_gives_each_server_its_own_port_even_when_the_kernel_reuses_one(
    tmp_path, models, monkeypatch, unqualified
):
    monkeypatch.setattr("muser.cli.config.socket.socket", _LowestFreePort)
    path = init_cluster(tmp_path / "c", target=models[0], draft=models[1])
    cfg = load_config(path)
    ports = {cfg.verifier.address, cfg.verifier.http, cfg.proposer.address, cfg.proposer.http}
    assert sorted(a.rsplit(":", 1)[1] for a in ports) == ["20000", "20001", "20002", "20003"]
    check_rules(cfg)


def test_private_keys_are_written_0600(cluster_file):
    cfg = load_config(cluster_file)
    for key in (cfg.verifier.key, cfg.proposer.key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_unknown_key_is_refused_not_ignored(cluster_file, capsys):
    edit(cluster_file, "[lane]\n", "[lane]\nspeculate_harder = true\n")
    with pytest.raises(ConfigError, match=r"lane.speculate_harder: Extra inputs are not permitted"):
        load_config(cluster_file)
    assert main(["config", "check", str(cluster_file)]) == 2
    assert "speculate_harder" in capsys.readouterr().err


def test_bad_address_is_quoted_with_its_path(cluster_file):
    cfg = load_config(cluster_file)
    edit(cluster_file, cfg.verifier.address, "localhost")
    with pytest.raises(ConfigError, match=r"verifier.address: .*got 'localhost'"):
        load_config(cluster_file)


def test_out_of_range_value_is_quoted(cluster_file):
    edit(cluster_file, "draft_len = 4", "draft_len = -3")
    with pytest.raises(ConfigError, match=r"lane.draft_len: .*got -3"):
        load_config(cluster_file)


def test_two_nodes_on_one_address_refused(cluster_file):
    cfg = load_config(cluster_file)
    edit(cluster_file, cfg.proposer.address, cfg.verifier.address)
    with pytest.raises(ConfigError, match="both use .* give each server its own"):
        check_rules(load_config(cluster_file))


def test_mismatched_key_pair_refused(cluster_file):
    edit(cluster_file, 'public_key = "keys/verifier.pub"', 'public_key = "keys/proposer.pub"')
    with pytest.raises(ConfigError, match="not the public half"):
        check_rules(load_config(cluster_file))


def test_unenrolled_verifier_key_refused(cluster_file):
    edit(cluster_file, 'verifiers = ["keys/verifier.pub"]', 'verifiers = ["keys/proposer.pub"]')
    with pytest.raises(ConfigError, match="not in enrolment.verifiers"):
        check_rules(load_config(cluster_file))


def test_missing_model_directory_refused(cluster_file, tmp_path):
    cfg = load_config(cluster_file)
    edit(cluster_file, str(cfg.verifier.target), str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"verifier.target .* has no config.json"):
        check_rules(load_config(cluster_file))


def test_unparsable_and_missing_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[verifier\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_config(tmp_path / "absent.toml")


def test_init_refuses_to_overwrite(cluster_file, models):
    from muser.errors import RefusedError

    with pytest.raises(RefusedError, match="exists; pass --force"):
        init_cluster(cluster_file.parent, target=models[0], draft=models[1])


def test_keygen_json(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path), "--name", "a", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"a"} and len(out["a"]["key_id"]) == 16
    assert main(["keygen", "--out", str(tmp_path), "--name", "a"]) == 2
