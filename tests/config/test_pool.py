"""A verifier pool in the cluster file ([[pool]]): parsed with paths beside the file, each
verifier named once, every key enrolled, and all qualified on one target identity."""

from __future__ import annotations

import dataclasses

import pytest

from cluster_config import load_config
from cluster_config import qualification as q
from cluster_config.schema import ConfigError
from muser import keys
from muser_app.cli.config import init_cluster
from muser_app.cli.main import main
from tests.config.test_rules import refused

EVIDENCE = q.Evidence(1, "00" * 32, 256, 1e-4, 256, 1e-6, 100, 80)


@pytest.fixture
def pooled(tmp_path, tiny_pair, monkeypatch):
    """A loopback cluster with a pool of one more verifier "b": its key enrolled, and a
    receipt for each verifier, signed by its key, on the cluster's own binding."""
    monkeypatch.setattr(q, "require_receipt", lambda config: None)  # tiny random models
    path = init_cluster(tmp_path, target=tiny_pair[0], draft=tiny_pair[1])
    keys.write_keypair(keys.generate(), tmp_path / "keys/b.key", tmp_path / "keys/b.pub")
    text = path.read_text().replace(
        'verifiers = ["keys/verifier.pub"]', 'verifiers = ["keys/verifier.pub", "keys/b.pub"]'
    )
    text += (
        '\n[[pool]]\nname = "b"\naddress = "127.0.0.1:1"\npublic_key = "keys/b.pub"\n'
        'receipt = "qualification-b.json"\n'
    )
    path.write_text(text)
    config = load_config(path)
    binding = q.binding_of(config)
    for key, receipt in (("verifier", "qualification.json"), ("b", "qualification-b.json")):
        signed = q.sign(binding, EVIDENCE, keys.load_private(tmp_path / f"keys/{key}.key"))
        q.write_receipt(tmp_path / receipt, signed)
    return path


def test_a_pool_is_read_with_its_paths_beside_the_file(pooled, capsys):
    config = load_config(pooled)
    assert [(v.name, v.address) for v in config.pool] == [("b", "127.0.0.1:1")]
    assert config.pool[0].public_key == pooled.parent / "keys/b.pub"
    assert config.pool[0].receipt == pooled.parent / "qualification-b.json"
    assert config.verifiers() == [("verifier", config.verifier.address), ("b", "127.0.0.1:1")]
    assert config.proposer.failover_s == 5.0
    assert main(["config", "check", str(pooled)]) == 0


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "b"', 'name = "verifier"', "names name 'verifier' twice"),
        ('name = "b"', 'name = "B b"', "pool.0.name: String should match pattern"),
        ('address = "127.0.0.1:1"', 'address = "nowhere"', "pool.0.address"),
    ],
)
def test_a_pool_verifier_named_twice_or_badly_is_refused(pooled, old, new, message):
    pooled.write_text(pooled.read_text().replace(old, new))
    with pytest.raises(ConfigError, match=message):
        load_config(pooled)


def test_the_same_address_twice_is_refused(pooled):
    address = load_config(pooled).verifier.address
    pooled.write_text(
        pooled.read_text().replace('address = "127.0.0.1:1"', f'address = "{address}"')
    )
    with pytest.raises(ConfigError, match=f"names address '{address}' twice"):
        load_config(pooled)


def test_a_pool_verifier_whose_key_is_not_enrolled_is_refused(pooled, capsys):
    pooled.write_text(pooled.read_text().replace(', "keys/b.pub"]', "]"))
    message = refused(pooled, capsys, "--role", "proposer")
    assert "pool verifier 'b'" in message and "not in enrolment.verifiers" in message
    # the verifier's own check does not read the proposer's pool
    assert main(["config", "check", str(pooled), "--role", "verifier"]) == 0


def test_a_pool_verifier_with_the_primarys_key_is_refused(pooled, capsys):
    pooled.write_text(
        pooled.read_text().replace('public_key = "keys/b.pub"', 'public_key = "keys/verifier.pub"')
    )
    assert "pool verifiers 'verifier' and 'b' have one key" in refused(pooled, capsys)


def test_a_pool_of_mixed_target_identities_is_refused_naming_them(pooled, capsys):
    """Verifier b was qualified on the same model in bfloat16: another target engine."""
    config = load_config(pooled)
    binding = q.binding_of(config)
    other = dataclasses.replace(
        binding, target=dataclasses.replace(binding.target, dtype="bfloat16")
    )
    signed = q.sign(other, EVIDENCE, keys.load_private(pooled.parent / "keys/b.key"))
    q.write_receipt(pooled.parent / "qualification-b.json", signed)
    message = refused(pooled, capsys)
    assert "the verifier pool mixes 2 target identities" in message
    assert "'verifier': model" in message and "torch float32" in message
    assert "'b': model" in message and "torch bfloat16" in message


def test_a_pool_verifier_receipt_signed_by_another_key_is_refused(pooled, capsys):
    config = load_config(pooled)
    signed = q.sign(
        q.binding_of(config), EVIDENCE, keys.load_private(pooled.parent / "keys/verifier.key")
    )
    q.write_receipt(pooled.parent / "qualification-b.json", signed)
    message = refused(pooled, capsys)
    assert "pool verifier 'b': its receipt" in message and "not by its key" in message


def test_a_pool_verifier_without_a_receipt_is_refused(pooled, capsys):
    (pooled.parent / "qualification-b.json").unlink()
    assert "no qualification receipt at" in refused(pooled, capsys)


def test_failover_s_must_be_positive(pooled):
    pooled.write_text(pooled.read_text().replace("[proposer]\n", "[proposer]\nfailover_s = 0\n", 1))
    with pytest.raises(ConfigError, match="proposer.failover_s: Input should be greater than 0"):
        load_config(pooled)
