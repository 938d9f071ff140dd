"""cluster.toml: strict schema, refusal rules, keygen, `muser config` exit codes."""

from __future__ import annotations

import json
import stat

import pytest

from cluster_config import load_config
from cluster_config.schema import ConfigError
from muser_app.checks import check_config
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main
from muser_app.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_tiny_checkpoint(root / "t", seed=1), make_tiny_checkpoint(root / "d", seed=2)


@pytest.fixture
def cluster_file(tmp_path, models):
    return init_cluster(tmp_path / "c", target=models[0], draft=models[1])


def test_init_writes_a_config_that_checks(cluster_file, unqualified, capsys):
    cfg = load_config(cluster_file)
    check_config(cfg)
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
    monkeypatch.setattr("muser_app.cli.config.socket.socket", _LowestFreePort)
    path = init_cluster(tmp_path / "c", target=models[0], draft=models[1])
    cfg = load_config(path)
    ports = {cfg.verifier.address, cfg.verifier.http, cfg.proposer.address, cfg.proposer.http}
    assert sorted(a.rsplit(":", 1)[1] for a in ports) == ["20000", "20001", "20002", "20003"]
    check_config(cfg)


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
        check_config(load_config(cluster_file))


def test_mismatched_key_pair_refused(cluster_file):
    edit(cluster_file, 'public_key = "keys/verifier.pub"', 'public_key = "keys/proposer.pub"')
    with pytest.raises(ConfigError, match="not the public half"):
        check_config(load_config(cluster_file))


def test_unenrolled_verifier_key_refused(cluster_file):
    edit(cluster_file, 'verifiers = ["keys/verifier.pub"]', 'verifiers = ["keys/proposer.pub"]')
    with pytest.raises(ConfigError, match="not in enrolment.verifiers"):
        check_config(load_config(cluster_file))


def test_missing_model_directory_refused(cluster_file, tmp_path):
    cfg = load_config(cluster_file)
    edit(cluster_file, str(cfg.verifier.target), str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"verifier.target .* has no config.json"):
        check_config(load_config(cluster_file))


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


def test_init_keeps_keys_it_finds_unless_forced(tmp_path, models, capsys):
    """Regression: config init wrote fresh keys over existing ones (no cluster.toml there),
    losing a node's private key."""
    keys = tmp_path / "c" / "keys"
    keys.mkdir(parents=True)
    (keys / "verifier.key").write_bytes(b"the node's own key")
    argv = ["config", "init", "--dir", str(tmp_path / "c")]
    argv += ["--target", str(models[0]), "--draft", str(models[1])]
    assert main(argv) == 2
    assert f"{keys / 'verifier.key'} exists; pass --force" in capsys.readouterr().err
    assert (keys / "verifier.key").read_bytes() == b"the node's own key"
    assert sorted(p.name for p in (tmp_path / "c").rglob("*")) == ["keys", "verifier.key"]
    assert main([*argv, "--force"]) == 0
    assert (keys / "verifier.key").read_bytes() != b"the node's own key"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft-len", "-1"], "--draft-len -1 received; expected 0 to 64"),
        (["--draft-len", "65"], "--draft-len 65 received; expected 0 to 64"),
        (["--target", "{tmp}"], "--target {tmp} has no config.json"),
        (["--draft", "{tmp}/nowhere"], "--draft {tmp}/nowhere has no config.json"),
    ],
)
def test_init_refuses_what_config_check_would_before_writing(
    tmp_path, models, capsys, extra, message
):
    """Regression: these wrote keys and a cluster.toml that `config check` then refused."""
    tmp = str(tmp_path)
    argv = ["config", "init", "--dir", str(tmp_path / "c")]
    argv += ["--target", str(models[0]), "--draft", str(models[1])]
    assert main([*argv, *(e.format(tmp=tmp) for e in extra)]) == 2
    assert message.format(tmp=tmp) in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_init_into_a_file_is_refused(tmp_path, models, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where, message in (
        (afile, f"--dir {afile} is a file; expected a directory"),
        (afile / "sub", f"--dir {afile / 'sub'}: cannot create it"),
    ):
        argv = ["config", "init", "--dir", str(where)]
        assert main([*argv, "--target", str(models[0]), "--draft", str(models[1])]) == 2
        assert message in capsys.readouterr().err
    assert afile.read_text() == "x"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--name", "../escaped"], "--name '../escaped' received; expected letters, digits"),
        (["--name", ""], "--name '' received"),
        (["--name", ".hidden"], "--name '.hidden' received"),
        (["--name", "x", "--name", "x"], "--name x given twice"),
        (["--tls", "--host", "bad host!"], "--host 'bad host!' received; expected a DNS name"),
        (["--tls", "--host", ""], "--host '' received"),
    ],
)
def test_keygen_refuses_names_and_hosts_it_cannot_use(tmp_path, capsys, argv, message):
    """Regression: --name ../escaped wrote outside --out, '' a hidden '.key', a repeated
    name overwrote its own pair; a bad --host went into the certificates."""
    assert main(["keygen", "--out", str(tmp_path / "k"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "k").exists() and not (tmp_path / "escaped.key").exists()


def test_keygen_takes_ip_and_dns_hosts_and_refuses_a_file_for_out(tmp_path, capsys):
    argv = ["keygen", "--out", str(tmp_path / "k"), "--name", "v", "--tls"]
    assert main([*argv, "--host", "10.0.0.7", "--host", "::1", "--host", "gx10.local"]) == 0
    assert (tmp_path / "k" / "tls" / "v.pem").is_file()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["keygen", "--out", str(afile)]) == 2
    assert f"--out {afile} is a file; expected a directory" in capsys.readouterr().err


def test_keygen_json(tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path), "--name", "a", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"a"} and len(out["a"]["key_id"]) == 16
    assert main(["keygen", "--out", str(tmp_path), "--name", "a"]) == 2


def test_init_gives_each_daemon_half_of_the_cpus(tmp_path, models, monkeypatch):
    from muser import affinity

    monkeypatch.setattr(affinity, "allowed", lambda: frozenset({0, 1, 2, 3, 5}))
    cfg = load_config(init_cluster(tmp_path / "c", target=models[0], draft=models[1]))
    assert (cfg.proposer.cpus, cfg.verifier.cpus) == ([0, 1], [2, 3, 5])


@pytest.mark.parametrize("cpus", [None, frozenset({0})])
def test_init_pins_nothing_where_there_is_nothing_to_split(tmp_path, models, monkeypatch, cpus):
    from muser import affinity

    monkeypatch.setattr(affinity, "allowed", lambda: cpus)
    path = init_cluster(tmp_path / "c", target=models[0], draft=models[1])
    cfg = load_config(path)
    assert (cfg.proposer.cpus, cfg.verifier.cpus) == (None, None)
    assert path.read_text().count("# cpus = [...]") == 2  # the setting is still documented


@pytest.mark.parametrize("value", ["[]", "[0, 0]", "[-1]", '"0"'])
def test_bad_cpus_are_quoted_with_their_path(cluster_file, value):
    text = cluster_file.read_text()
    head, sep, rest = text.partition("\n[proposer]")
    head = "".join(line for line in head.splitlines(True) if not line.startswith("cpus = "))
    cluster_file.write_text(
        head.replace("[verifier]\n", f"[verifier]\ncpus = {value}\n") + sep + rest
    )
    with pytest.raises(ConfigError, match=r"verifier.cpus: .*got "):
        load_config(cluster_file)


def test_cpus_this_machine_does_not_give_are_refused_for_that_node_only(
    cluster_file, unqualified, monkeypatch
):
    from muser import affinity

    monkeypatch.setattr(affinity, "allowed", lambda: frozenset({0, 1}))
    text = "".join(
        line for line in cluster_file.read_text().splitlines(True) if not line.startswith("cpus = ")
    )
    cluster_file.write_text(
        text.replace('wal_dir = "wal/proposer"\n', 'wal_dir = "wal/proposer"\ncpus = [1, 7]\n')
    )
    cfg = load_config(cluster_file)
    with pytest.raises(
        ConfigError, match=r"proposer.cpus \[1, 7\] names CPU 7, but .* CPUs \[0, 1\]"
    ):
        check_config(cfg)
    check_config(cfg, role="verifier")  # another machine's CPUs are not this one's to check
    with pytest.raises(ConfigError, match="proposer.cpus"):
        check_config(cfg, role="proposer")
