"""Public keys handed to `muser wal verify --pubkey FILE` (raw PEM bytes), by key id."""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from muser import keys


def keys_by_id(pems: Sequence[bytes]) -> dict[str, Ed25519PublicKey]:
    out = {}
    for pem in pems:
        key = keys.public_from_pem(pem, "a --pubkey")
        out[keys.key_id(key)] = key
    return out
