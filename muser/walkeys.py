"""Public keys handed to `muser wal verify --pubkey FILE` (raw PEM bytes), by key id."""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys


def keys_by_id(pems: Sequence[bytes]) -> dict[str, Ed25519PublicKey]:
    out = {}
    for pem in pems:
        key = serialization.load_pem_public_key(pem)
        if not isinstance(key, Ed25519PublicKey):
            raise keys.KeyFileError(f"a --pubkey holds a {type(key).__name__}, not Ed25519")
        out[keys.key_id(key)] = keys.check_point(key, "a --pubkey")
    return out
