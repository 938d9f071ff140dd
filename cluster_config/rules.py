"""Refusal rules checked by `muser config check` and again when a daemon starts.

Each rule raises `ConfigError` with a message that tells the operator what to change.
Only cheap checks live here (files, keys, addresses); model-level checks (tokenizer
digests) run where the models are loaded.
"""

from __future__ import annotations

from pathlib import Path

from cluster_config.schema import ClusterConfig, ConfigError


def _keys_match(private: Path, public: Path, role: str) -> str:
    from muser import keys

    priv = keys.load_private(private)
    pub = keys.load_public(public)
    if keys.key_id(priv.public_key()) != keys.key_id(pub):
        raise ConfigError(
            f"{role}.public_key {public} is not the public half of {role}.key {private}; "
            f"regenerate the pair with `muser keygen`"
        )
    return keys.key_id(pub)


def check_rules(config: ClusterConfig) -> None:
    from muser import keys

    if config.verifier.address == config.proposer.address:
        raise ConfigError(
            f"verifier.address and proposer.address are both {config.verifier.address!r}; "
            "give each node its own HOST:PORT"
        )
    for role, node, model_field in (
        ("verifier", config.verifier, "target"),
        ("proposer", config.proposer, "draft"),
    ):
        model_dir = getattr(node, model_field)
        if not (Path(model_dir) / "config.json").is_file():
            raise ConfigError(
                f"{role}.{model_field} {model_dir} has no config.json: point it at a Hugging "
                "Face checkpoint directory (or run `muser fixtures build`)"
            )
    verifier_id = _keys_match(config.verifier.key, config.verifier.public_key, "verifier")
    proposer_id = _keys_match(config.proposer.key, config.proposer.public_key, "proposer")
    enrolled_verifiers = {keys.key_id(keys.load_public(p)) for p in config.enrolment.verifiers}
    enrolled_proposers = {keys.key_id(keys.load_public(p)) for p in config.enrolment.proposers}
    if verifier_id not in enrolled_verifiers:
        raise ConfigError(
            f"the verifier's key {verifier_id} is not in enrolment.verifiers; add "
            f"{config.verifier.public_key} there"
        )
    if proposer_id not in enrolled_proposers:
        raise ConfigError(
            f"the proposer's key {proposer_id} is not in enrolment.proposers; add "
            f"{config.proposer.public_key} there"
        )
